"""What a calibration will cost before it runs: the memory plan (:mod:`loopq.planning.memory`, ``loopq.fit
--print_plan``) and the guards on run roots, result files and loop counts (:mod:`loopq.planning.guards`)."""
