"""lm-eval's `local-completions`, run unchanged against the server on a local task (no download): both
generate_until and loglikelihood, with the remote and the huggingface tokenizer backends."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import API_KEY, MAX_MODEL_LEN, MODEL, child_env

pytestmark = pytest.mark.skipif(shutil.which("lm_eval") is None and not Path(sys.executable).with_name(
    "lm_eval").exists(), reason="lm-eval is not installed (pip install 'lm-eval[api]')")

GEN_TASK = """task: arith_gen
dataset_path: json
dataset_kwargs: {data_files: {test: DIR/arith.jsonl}}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: "{{answer}}"
target_delimiter: " "
num_fewshot: 2
fewshot_config:
  sampler: first_n
  samples:
    - {question: "What is 2 plus 3?", answer: "2 + 3 = 5\\n#### 5"}
    - {question: "What is 9 minus 4?", answer: "9 - 4 = 5\\n#### 5"}
generation_kwargs: {until: ["Question:", "\\n\\n"], do_sample: false, temperature: 0.0, max_gen_toks: 24}
filter_list:
  - name: strict-match
    filter: [{function: regex, regex_pattern: "#### (\\\\-?[0-9]+)"}, {function: take_first}]
metric_list:
  - {metric: exact_match, aggregation: mean, higher_is_better: true, ignore_case: true}
metadata: {version: 1.0}
"""

MC_TASK = """task: arith_mc
dataset_path: json
dataset_kwargs: {data_files: {test: DIR/arith_mc.jsonl}}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - {metric: acc, aggregation: mean, higher_is_better: true}
metadata: {version: 1.0}
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    pairs = [(12, 7), (25, 39), (8, 8), (31, 4), (6, 17), (40, 2)]
    with open(folder / "arith.jsonl", "w") as f:
        for a, b in pairs:
            f.write(json.dumps({"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
                    + "\n")
    with open(folder / "arith_mc.jsonl", "w") as f:
        for a, b in pairs:
            s = a + b
            f.write(json.dumps({"question": f"What is {a} plus {b}?", "choices": [str(s), str(s + 10), str(s - 1),
                                                                              str(s + 1)], "label": 0}) + "\n")
    (folder / "arith_gen.yaml").write_text(GEN_TASK.replace("DIR", str(folder)))
    (folder / "arith_mc.yaml").write_text(MC_TASK.replace("DIR", str(folder)))
    return folder


def _start_lm_eval(server, task_dir: Path, out: Path, model_args: str, *extra: str) -> subprocess.Popen:
    lm_eval = shutil.which("lm_eval") or str(Path(sys.executable).with_name("lm_eval"))
    cmd = [lm_eval, "--model", "local-completions", "--include_path", str(task_dir), "--tasks", "arith_gen,arith_mc",
           "--output_path", str(out), "--log_samples", "--model_args",
           f"base_url={server.url}/v1/completions,model={MODEL},max_length={MAX_MODEL_LEN},{model_args}", *extra]
    env = {**child_env(), "OPENAI_API_KEY": API_KEY}
    with open(out / "log.txt", "w") as log:
        return subprocess.Popen(cmd, cwd=task_dir, env=env, stdout=log, stderr=subprocess.STDOUT)


def _finish_lm_eval(process: subprocess.Popen, out: Path) -> tuple[dict, list[dict], list[dict]]:
    process.wait(timeout=300)
    assert process.returncode == 0, (out / "log.txt").read_text()[-5000:]
    (results_file,) = out.glob(f"{MODEL}/results_*.json")

    def samples(task: str) -> list[dict]:
        return [json.loads(line) for f in out.glob(f"{MODEL}/samples_{task}_*.jsonl") for line in open(f)]

    return json.loads(results_file.read_text()), samples("arith_mc"), samples("arith_gen")


def _loglikelihoods(samples: list[dict]) -> dict[tuple[str, str], float]:
    """(context, continuation) -> the log-likelihood lm-eval computed from the server's answer."""
    found = {}
    for sample in samples:
        for args, resp in zip(sample["arguments"].values(), sample["filtered_resps"], strict=True):
            found[(args["arg_0"], args["arg_1"])] = float(resp[0])
    return found


def _engine_loglikelihood(server, tokenizer, context: str, continuation: str) -> float:
    """The same score from the engine's own prompt logprobs (lm-eval's split: trailing spaces move right)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    ctx_len = len(tokenizer(context, add_special_tokens=False).input_ids)
    body = {"model": MODEL, "prompt": whole, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=60).json()
    positions = answer["choices"][0]["prompt_logprobs"]
    return sum(positions[i][str(t)]["logprob"] for i, t in enumerate(whole) if i >= ctx_len)


@pytest.fixture(scope="module")
def runs(server, task_dir, tmp_path_factory):
    """Both backends at once (lm-eval spends most of its start-up indexing its built-in tasks)."""
    outs = {"remote": tmp_path_factory.mktemp("out_remote"), "huggingface": tmp_path_factory.mktemp("out_hf")}
    processes = {
        "remote": _start_lm_eval(server, task_dir, outs["remote"], "tokenizer_backend=remote"),
        "huggingface": _start_lm_eval(server, task_dir, outs["huggingface"],
                                      f"tokenizer={server.checkpoint},tokenizer_backend=huggingface,"
                                      "tokenized_requests=True,num_concurrent=4", "--batch_size", "4")}
    try:
        return {name: _finish_lm_eval(process, outs[name]) for name, process in processes.items()}
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.mark.parametrize("backend", ["remote", "huggingface"])
def test_lm_eval_finishes_both_tasks_with_scores(runs, backend):
    results, samples, _ = runs[backend]
    assert 0.0 <= results["results"]["arith_gen"]["exact_match,strict-match"] <= 1.0
    assert 0.0 <= results["results"]["arith_mc"]["acc,none"] <= 1.0
    assert len(samples) == 6 and all(len(s["filtered_resps"]) == 4 for s in samples)


@pytest.mark.parametrize("backend", ["remote", "huggingface"])
def test_lm_eval_loglikelihoods_equal_the_engines_prompt_logprobs(runs, backend, server, tokenizer):
    found = _loglikelihoods(runs[backend][1])
    assert len(found) == 24
    for (context, continuation), ll in found.items():
        assert ll == pytest.approx(_engine_loglikelihood(server, tokenizer, context, continuation), abs=1e-4)


def test_both_tokenizer_backends_agree(runs):
    remote, hf = _loglikelihoods(runs["remote"][1]), _loglikelihoods(runs["huggingface"][1])
    assert remote.keys() == hf.keys()
    for key in remote:
        assert remote[key] == pytest.approx(hf[key], abs=1e-4)


def test_generations_come_back_cut_at_the_stop_strings(runs):
    for backend in ("remote", "huggingface"):
        generations = [r for s in runs[backend][2] for r in s["resps"][0]]
        assert len(generations) == 6
        assert not any("Question:" in g or "\n\n" in g for g in generations)
