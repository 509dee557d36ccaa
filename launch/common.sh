# Shared by the launchers (sourced, not run).

# config_get CONFIG a.b.c -> the value at that key of a YAML config ("" when absent)
config_get() {
    python - "$1" "$2" <<'PY'
import sys, yaml
node = yaml.safe_load(open(sys.argv[1])) or {}
for key in sys.argv[2].split("."):
    node = node.get(key) if isinstance(node, dict) else None
print("" if node is None else node)
PY
}

# per_process_batch CONFIG WORLD_SIZE -> data.batch_size per process. A config's data.batch_size is the global
# batch of its recipe (what one process computes alone); loopq.fit takes the per-process size. $GLOBAL_BATCH
# overrides the config's value.
per_process_batch() {
    local global=${GLOBAL_BATCH:-$(config_get "$1" data.batch_size)}
    global=${global:-4}
    if (( global % $2 )); then
        echo "global batch $global is not divisible by $2 processes; set GLOBAL_BATCH to a multiple of $2" >&2
        return 2
    fi
    echo $(( global / $2 ))
}

# ddp_default CONFIG -> the strategy override for a config that names none: progressive SLT promotion needs
# DDP with find_unused_parameters (Lightning's "auto" picks plain DDP for several devices)
ddp_default() {
    if [[ -z $(config_get "$1" trainer.strategy) ]]; then echo "--trainer.strategy ddp_find_unused_parameters_true"; fi
}

# visible_gpus -> number of GPUs nvidia-smi lists (1 when there is none: a CPU test run)
visible_gpus() {
    local n
    n=$(nvidia-smi -L 2>/dev/null | wc -l)
    echo $(( n > 0 ? n : 1 ))
}
