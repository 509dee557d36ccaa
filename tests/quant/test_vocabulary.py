"""One vocabulary for methods and bit widths (loopq.quant.config)."""

import pytest

from loopq.quant import QuantConfig
from loopq.quant.config import METHODS, QuantConfigError, bits_label, method_of_label, parse_bits


def test_bits_labels_round_trip():
    assert parse_bits("w4a4") == (4, 4) and parse_bits(" W4A8 ") == (4, 8)
    assert bits_label(*parse_bits("w3a3")) == "w3a3"
    assert QuantConfig.rtn(4, 8).bits_label == "w4a8"


@pytest.mark.parametrize(("label", "why"), [("4bit", "w<W>a<A>"), ("w5a4", "5-bit w"), ("w4a2", "2-bit a")])
def test_bad_bits_labels_name_the_key(label, why):
    with pytest.raises(QuantConfigError, match=rf"^--bits '{label}': .*{why}"):
        parse_bits(label, "--bits")


def test_method_labels():
    assert [m.label for m in METHODS.values()] == ["LoopQ", "Symmetric", "SmoothQuant", "QuaRot", "SpinQuant",
                                                   "FlatQuant"]  # fmt: skip
    assert method_of_label("QUAROT") == "quarot" and method_of_label("Symmetric") == "rtn"
    assert method_of_label("RTN-g128") == "rtn" and method_of_label("loopq") == "loopq"
    assert method_of_label("QuaRott") is None
    assert QuantConfig.flatquant().label == "FlatQuant"
