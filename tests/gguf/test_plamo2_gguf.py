"""PLaMo2 GGUF files written by llama.cpp's own converter (from a checkpoint with PLaMo's tokenizer.jsonl, which the
converter reads): an F32 file gives the tokens and logprobs mlx-lm gives the checkpoint it came from; a Q8_0 file
(linear layers, embedding and head in blocks) gives mlx-lm's on the checkpoint with those weights replaced by gguf-py's
dequantized values; the converter's norm offsets, A = -exp(A_log) and squeezed conv come back as the checkpoint's
tensors; metadata strata does not read is refused; the file's own `plamo2` tokenizer serves prompt strings."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from checkpoints import write_tokenizer
from llama_cpp_gguf import convert
from mamba_checkpoints import make_plamo2, plamo2_is_mamba
from plamo2_oracle import mlx_logits, needs_mlx
from safetensors.torch import load_file, save_file

from strata import LLM, SamplingParams
from strata.config import HFConfig
from strata.errors import UnsupportedModelError
from strata.gguf.config import hf_config
from strata.gguf.reader import GGUFModel
from strata.gguf.weights import iterate_gguf
from strata.models.plamo2 import is_mamba

MAX_TOKENS = 10
VOCAB = 300
PROMPTS = [torch.randint(5, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 11, 40)]
# PLaMo's own tokenizer format: [piece, score, type] per line; llama.cpp's PLaMo2 tokenizer needs all 256 byte pieces.
SPECIALS = ["<|plamo:unk|>", "<|plamo:bos|>", "<|plamo:eos|>", "<|plamo:pad|>", "<|plamo:op|>"]
WORDS = ["a", "b", "ab", "the", " the", "cat", " cat"]


def write_plamo_tokenizer(folder) -> None:
    """tokenizer.jsonl and the tokenizer_config.json naming its special pieces, as PLaMo2's repositories hold them."""
    lines = [[s, 0.0, "CONTROL" if i else "UNKNOWN"] for i, s in enumerate(SPECIALS)]
    lines += [[f"<0x{b:02X}>", 0.0, "BYTE"] for b in range(256)]
    lines += [[w, -float(i), "NORMAL"] for i, w in enumerate(WORDS)]
    (folder / "tokenizer.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = {"bos_token": SPECIALS[1], "eos_token": SPECIALS[2], "pad_token": SPECIALS[3], "unk_token": SPECIALS[0]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def make_plamo2_checkpoint(folder, **shape):
    path = make_plamo2(folder, vocab_size=VOCAB, **shape)
    write_plamo_tokenizer(path)
    return path


# Mamba, attention, Mamba, attention; two KV heads; an untied head.
SHAPE = dict(num_layers=4, mamba_step=2, num_kv_heads=2, tied=False)


@pytest.fixture(scope="module")
def plamo2(tmp_path_factory):
    """(the checkpoint, its F32 GGUF file, a folder with a tokenizer strata can load for token-id prompts)."""
    root = tmp_path_factory.mktemp("plamo2_gguf")
    hf = make_plamo2_checkpoint(root / "hf", **SHAPE)
    tokenizer = root / "tokenizer"
    tokenizer.mkdir()
    write_tokenizer(tokenizer, 256)
    return hf, convert(hf, root / "plamo2-f32.gguf"), tokenizer


def strata_greedy(path, tokenizer, **engine_args) -> list:
    llm = LLM(str(path), tokenizer=str(tokenizer), dtype="float32", device="cpu", max_model_len=64, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


def assert_matches_mlx(outputs: list, checkpoint) -> None:
    """mlx-lm's greedy tokens (full recompute), and each reported logprob within 1e-4 of its log-softmax."""
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        sequence = list(prompt)
        for _ in range(MAX_TOKENS):
            sequence.append(int(mlx_logits(checkpoint, sequence)[-1].argmax()))
        got = out.outputs[0]
        assert got.token_ids == sequence[len(prompt):]
        logprobs = torch.log_softmax(mlx_logits(checkpoint, sequence[:-1])[len(prompt) - 1:], dim=-1)
        for position, top in enumerate(got.logprobs):
            for token, logprob in top.items():
                assert abs(logprob.logprob - float(logprobs[position, token])) < 1e-4


@needs_mlx
def test_f32_file_gives_mlx_lm_tokens_of_the_checkpoint(plamo2):
    hf, path, tokenizer = plamo2
    assert_matches_mlx(strata_greedy(path, tokenizer), hf)


def quantized_names(layers: int, mamba_step: int, tied: bool) -> dict[str, str]:
    """The converter's PLaMo2 table for the matrices a Q8_0 file keeps in blocks, written out here."""
    names = {"token_embd.weight": "model.embed_tokens.weight"}
    if not tied:
        names["output.weight"] = "lm_head.weight"
    for i in range(layers):
        p = f"model.layers.layers.{i}."
        names.update({f"blk.{i}.ffn_up.weight": p + "mlp.gate_up_proj.weight",
                      f"blk.{i}.ffn_down.weight": p + "mlp.down_proj.weight"})
        own = ({"ssm_in": "in_proj", "ssm_x": "bcdt_proj", "ssm_dt": "dt_proj", "ssm_out": "out_proj"}
               if plamo2_is_mamba(layers, mamba_step, i) else {"attn_qkv": "qkv_proj", "attn_output": "o_proj"})
        names.update({f"blk.{i}.{g}.weight": f"{p}mixer.{h}.weight" for g, h in own.items()})
    return names


@needs_mlx
def test_q8_0_file_gives_mlx_lm_tokens_of_the_dequantized_weights(plamo2, tmp_path):
    import gguf

    hf, _, tokenizer = plamo2
    path = convert(hf, tmp_path / "plamo2-q8_0.gguf", "q8_0")
    reader = gguf.GGUFReader(str(path))
    blocked = {t.name: t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q8_0}
    names = quantized_names(SHAPE["num_layers"], SHAPE["mamba_step"], SHAPE["tied"])
    assert blocked.keys() == names.keys()
    reference = tmp_path / "dequantized"
    shutil.copytree(hf, reference)
    state = load_file(str(reference / "model.safetensors"))
    for name, tensor in blocked.items():
        state[names[name]] = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
    save_file(state, str(reference / "model.safetensors"), metadata={"format": "pt"})
    assert_matches_mlx(strata_greedy(path, tokenizer), reference)


@pytest.mark.parametrize("shape", [SHAPE, dict(num_layers=6, mamba_step=4, num_kv_heads=1, tied=True)],
                         ids=["step2_untied", "step4_tied"])
def test_file_reads_back_as_the_checkpoint_tensors_and_config(plamo2, tmp_path, shape):
    """Every tensor under its checkpoint name and shape, the norms' offsets taken off again (equal up to the float32
    rounding of the converter's sum), A_log from -exp(A_log); the config's sizes and layer pattern."""
    hf, path, _ = plamo2
    if shape is not SHAPE:
        hf = make_plamo2_checkpoint(tmp_path / "hf", seed=5, **shape)
        path = convert(hf, tmp_path / "plamo2.gguf")
    stored = load_file(str(hf / "model.safetensors"))
    read = dict(iterate_gguf(GGUFModel([path])))
    assert read.keys() == stored.keys()
    for name, tensor in stored.items():
        assert read[name].shape == tensor.shape, name
        torch.testing.assert_close(read[name], tensor, rtol=0, atol=3e-7, msg=name)
    written = json.loads((hf / "config.json").read_text())
    config = hf_config(GGUFModel([path]))
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "hidden_size_per_head", "intermediate_size", "mamba_d_state", "mamba_d_conv", "mamba_num_heads",
                "vocab_size", "tie_word_embeddings", "max_position_embeddings"):
        assert config[key] == written[key], key
    assert config["rms_norm_eps"] == pytest.approx(written["rms_norm_eps"])
    pattern = [is_mamba(HFConfig(config), i) for i in range(shape["num_layers"])]
    assert pattern == [plamo2_is_mamba(shape["num_layers"], shape["mamba_step"], i) for i in range(len(pattern))]


def test_metadata_strata_does_not_read_is_refused_by_name(plamo2):
    gguf = GGUFModel([plamo2[1]])
    hf_config(gguf)
    gguf.metadata["plamo2.attention.sliding_window"] = 2048
    with pytest.raises(UnsupportedModelError, match=r"plamo2\.attention\.sliding_window"):
        hf_config(gguf)


def test_file_serves_a_prompt_string_through_its_own_plamo2_tokenizer(plamo2):
    """No --tokenizer: the text is segmented by the file's vocabulary ("the" scores -3 and " cat" -6, better than
    any split into shorter pieces or bytes), and generation goes on as from the same ids given directly."""
    _, path, tokenizer = plamo2
    assert GGUFModel([path]).metadata["tokenizer.ggml.model"] == "plamo2"
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate("the cat", params, use_tqdm=False)[0]
    first_word = len(SPECIALS) + 256
    assert out.prompt_token_ids == [first_word + WORDS.index("the"), first_word + WORDS.index(" cat")]
    by_ids = LLM(str(path), tokenizer=str(tokenizer), dtype="float32", device="cpu", max_model_len=64)
    expected = by_ids.generate({"prompt_token_ids": out.prompt_token_ids}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids


@pytest.mark.slow
def test_tp2_pp2_give_the_tokens_of_one_process(plamo2, tmp_path):
    """Four ranks on the Q8_0 file: Mamba heads (in_proj's blocks regrouped per head), attention heads and the MLP
    split by TP=2, layers by PP=2."""
    hf, _, tokenizer = plamo2
    path = convert(hf, tmp_path / "plamo2-q8_0.gguf", "q8_0")
    one = [o.outputs[0].token_ids for o in strata_greedy(path, tokenizer)]
    split = strata_greedy(path, tokenizer, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert [o.outputs[0].token_ids for o in split] == one
