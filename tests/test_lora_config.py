"""enable_lora's options checked at start-up: positive sizes, max_cpu_loras >= max_loras."""
from __future__ import annotations

import pytest

from strata.config.lora_config import LoRAConfig, lora_config
from strata.errors import ConfigError


def test_lora_off_gives_no_config():
    assert lora_config(False, 4, 64, None) is None


def test_max_cpu_loras_defaults_to_max_loras():
    assert lora_config(True, 4, 64, None) == LoRAConfig(4, 64, 4)


@pytest.mark.parametrize("args, param", [((0, 16, None), "max_loras"), ((2, 0, None), "max_lora_rank"),
                                         ((4, 16, 2), "max_cpu_loras")])
def test_bad_sizes_are_refused(args, param):
    with pytest.raises(ConfigError) as e:
        lora_config(True, *args)
    assert e.value.param == param
