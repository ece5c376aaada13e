"""`strata plan`: per-rank layers, parameter and KV-cache bytes and traffic, and the same refusals as start-up."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from strata.cli import main
from strata.config import EngineConfig
from strata.plan import plan_layout

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llama5(tmp_path_factory) -> Path:
    from checkpoints import make_llama

    return make_llama(tmp_path_factory.mktemp("plan_llama5"), vocab_size=300, num_layers=5, num_heads=4,
                      num_kv_heads=2, seed=5)


def checkpoint_bytes(folder: Path) -> int:
    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            total += sum(f.get_tensor(name).nbytes for name in f.keys())
    return total


def test_plan_prints_every_rank_with_its_layers_bytes_and_traffic(llama5, capsys):
    assert main(["plan", str(llama5), "-tp", "2", "-pp", "2"]) == 0
    out = capsys.readouterr().out
    plans = plan_layout(EngineConfig.create(str(llama5), tensor_parallel_size=2, pipeline_parallel_size=2))
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
    # Stage 0 has layers 0-2 (vLLM's rule gives the remainder to the first stage), stage 1 layers 3-4.
    assert [r[4] for r in rows] == ["0-2", "0-2", "3-4", "3-4"]
    assert [int(r[6].replace(",", "")) for r in rows] == [p.param_bytes for p in plans]
    assert [(r[11], r[12]) for r in rows] == [("yes", "no"), ("yes", "no"), ("no", "yes"), ("no", "yes")]
    assert "TP all-reduce per rank" in out and "PP hand-off per stage boundary" in out
    per_layer = 2 * 1 * 16 * 4 * 1000  # K and V, 2 KV heads split over 2 ranks, head_dim 16, float32, 1k tokens
    assert [p.kv_bytes_per_1k_tokens for p in plans] == [3 * per_layer] * 2 + [2 * per_layer] * 2
    assert plans[0].send_bytes_per_token == 2 * 64 * 4 and plans[2].send_bytes_per_token == 0
    assert plans[0].allreduce_count == 1 + 2 * 3  # the embedding, then attention and MLP outputs of 3 layers


def test_pipeline_stages_split_the_checkpoint_without_overlap(llama5):
    plans = plan_layout(EngineConfig.create(str(llama5), pipeline_parallel_size=3))
    assert [p.layers for p in plans] == [(0, 2), (2, 4), (4, 5)]
    assert sum(p.param_bytes for p in plans) == checkpoint_bytes(llama5)


def test_a_tied_lm_head_brings_the_embedding_to_the_last_stage(llama_tied):
    plans = plan_layout(EngineConfig.create(str(llama_tied), pipeline_parallel_size=3))
    assert [(p.has_embedding, p.has_lm_head) for p in plans] == [(True, False), (False, False), (True, True)]
    # The first stage only looks rows up; on the last the table is the LM head, read whole.
    config = EngineConfig.create(str(llama_tied)).model.text_config
    assert [p.lookup_table_bytes for p in plans] == [config.vocab_size * config.hidden_size * 4, 0, 0]


def test_an_untied_embedding_table_counts_as_looked_up_not_read_whole(llama5):
    plans = plan_layout(EngineConfig.create(str(llama5), dtype="float32", tensor_parallel_size=2))
    assert [p.lookup_table_bytes for p in plans] == [320 * 64 * 4 // 2] * 2  # vocabulary padded to 320, split


def test_plan_shows_the_mamba_state_each_rank_keeps_per_sequence(tmp_path, capsys):
    from mamba_checkpoints import StepRunner, make_plamo2

    path = make_plamo2(tmp_path / "plamo2", num_layers=4, mamba_step=2)
    whole = StepRunner(path, max_num_seqs=1).runner.state_bytes()  # what the engine allocates per slot
    assert [p.state_bytes_per_seq for p in plan_layout(EngineConfig.create(str(path)))] == [whole]
    split = plan_layout(EngineConfig.create(str(path), tensor_parallel_size=2, pipeline_parallel_size=2))
    assert sum(p.state_bytes_per_seq for p in split) == whole  # heads split over TP, layers over PP
    assert main(["plan", str(path), "-tp", "2"]) == 0
    assert "state/seq" in capsys.readouterr().out


def test_plan_refuses_a_checkpoint_whose_tensors_do_not_fit_the_config(llama5, tmp_path):
    folder = Path(shutil.copytree(llama5, tmp_path / "wrong"))
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 256  # the stored MLP weights are 128 wide
    (folder / "config.json").write_text(json.dumps(config))
    from strata import ConfigError

    with pytest.raises(ConfigError, match="checkpoint does not match the model.*gate_proj"):
        plan_layout(EngineConfig.create(str(folder), tensor_parallel_size=2))


@pytest.mark.parametrize("flags, message", [
    (["-tp", "3"], "tensor_parallel_size=3 must divide num_attention_heads=4; sizes that work for this model: 1, 2, 4"),
    (["-pp", "6"], "pipeline_parallel_size=6 exceeds the model's 5 layers; use 1 to 5"),
    (["-pp", "2", "--pp-layer-partition", "1,3"], "pp_layer_partition=1,3 must have 2 positive entries"),
])
def test_plan_refuses_impossible_layouts_with_the_start_up_message(llama5, caplog, flags, message):
    with caplog.at_level(logging.ERROR, logger="strata"):
        assert main(["plan", str(llama5), *flags]) != 0
    assert any(message in r.getMessage() for r in caplog.records)


def test_strata_plan_command_exits_non_zero_for_an_impossible_layout(llama5):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "strata", "plan", str(llama5), "-tp", "3", "-pp", "2"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "tensor_parallel_size=3 must divide num_attention_heads=4" in done.stderr
    assert done.stdout == ""
