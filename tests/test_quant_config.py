"""Which TP sizes a quantized checkpoint allows: no rank may hold part of a quantization group or of a packed
element, along the inputs of row-parallel layers or the outputs of column-parallel pieces."""
from __future__ import annotations

import pytest

from strata.config.quant_config import AWQ, GPTQ, PACKED, LinearScheme, QuantConfig, quant_tp_problem


def _config(scheme: LinearScheme) -> QuantConfig:
    return QuantConfig("compressed-tensors", ((("Linear",), scheme),))


def test_per_channel_int4_refuses_a_tp_size_that_cuts_a_packed_int32_of_inputs():
    channel = _config(LinearScheme(PACKED, 4, -1, True))
    assert quant_tp_problem(2, channel, {"intermediate_size": 80}) is None  # 40 inputs: five whole int32s
    problem = quant_tp_problem(4, channel, {"intermediate_size": 80})
    assert problem == ("tensor_parallel_size=4 splits intermediate_size=80 into 20 inputs per rank, which cuts a "
                       "packed element of 8 inputs (4-bit pack-quantized weights); sizes that work: 1, 2")


@pytest.mark.parametrize(("scheme", "per_element"), [
    (LinearScheme(PACKED, 4, 32, False), 8),  # asymmetric: zero points packed along the outputs
    (LinearScheme(PACKED, 8, 32, False), 4),
    (LinearScheme(GPTQ, 4, 32, True), 8),  # qzeros, even when symmetric
    (LinearScheme(AWQ, 4, 32, False), 8),  # qweight itself
])
def test_outputs_packed_along_n_must_stay_whole_on_each_rank(scheme, per_element):
    heads = {"num_heads (dt)": (4 * per_element, 4 * per_element)}
    assert quant_tp_problem(4, _config(scheme), {}, heads) is None
    assert f"cuts a packed element of {per_element} outputs" in quant_tp_problem(8, _config(scheme), {}, heads)


def test_symmetric_pack_quantized_outputs_split_anywhere():
    assert quant_tp_problem(8, _config(LinearScheme(PACKED, 4, 32, True)), {}, {"num_heads (dt)": (8, 8)}) is None


def test_a_piece_with_fewer_units_than_ranks_is_replicated_whole():
    # One B/C group of 16 rows: every rank holds all 16, two whole int32s of zero points.
    asym = _config(LinearScheme(PACKED, 4, 32, False))
    assert quant_tp_problem(4, asym, {}, {"n_groups * state_size": (16, 1)}) is None
    assert "2 rows of" in quant_tp_problem(4, asym, {}, {"n_groups * state_size": (8, 4)})
