"""One vocabulary for methods and bit widths (loopq.quant.config)."""

import pytest

from loopq.quant import QuantConfig
from loopq.quant.config import METHODS, Bits, QuantConfigError, method_of_label


def test_bits_labels_round_trip():
    assert Bits.parse("w4a4") == Bits(4, 4) == (4, 4) and Bits.parse(" W4A8 ") == Bits(w=4, a=8)
    assert Bits.parse("w3a3").label == "w3a3" and Bits(4, 16).label == "w4a16"
    assert QuantConfig.rtn(4, 8).bits == Bits(4, 8)


@pytest.mark.parametrize(("label", "why"), [("4bit", "w<W>a<A>"), ("w5a4", "5-bit w"), ("w4a2", "2-bit a")])
def test_bad_bits_labels_name_the_key(label, why):
    with pytest.raises(QuantConfigError, match=rf"^--bits '{label}': .*{why}"):
        Bits.parse(label, "--bits")


def test_method_labels():
    assert [m.label for m in METHODS.values()] == ["LoopQ", "Symmetric", "SmoothQuant", "QuaRot", "SpinQuant",
                                                   "FlatQuant"]  # fmt: skip
    assert method_of_label("QUAROT") == "quarot" and method_of_label("Symmetric") == "rtn"
    assert method_of_label("RTN-g128") == "rtn" and method_of_label("loopq") == "loopq"
    assert method_of_label("QuaRott") is None
    assert QuantConfig.flatquant().label == "FlatQuant"
