"""Quantize a PLaMo2 checkpoint's linear layers with compressed-tensors itself (run in llm-compressor's environment,
by subprocess): PLaMo2 is remote code that llm-compressor's `oneshot` cannot load, so its `*_proj` weights are put
in plain `nn.Linear`s under their checkpoint names, observed with llm-compressor's weight observer, and compressed
by compressed-tensors' `ModelCompressor`, which also writes the `quantization_config`.

usage: python write_compressed_tensors_plamo2.py BASE_FOLDER OUT_PARENT SCHEME [SCHEME ...]
writes OUT_PARENT/SCHEME (compressed) and OUT_PARENT/SCHEME-dense: the same model with the weights that
compressed-tensors' decompression gives back from the saved tensors (the oracle's input). SCHEME as in
write_llmcompressor_checkpoint.py.
"""
import json
import shutil
import sys
from pathlib import Path

from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
from llmcompressor.modifiers.quantization.calibration import initialize_observer, observe, update_qparams
from safetensors.torch import load_file, save_file
from torch import nn
from write_llmcompressor_checkpoint import scheme_for


def linear_tree(weights: dict) -> nn.Module:
    """Every `*_proj.weight` matrix as an nn.Linear at its checkpoint path."""
    root = nn.Module()
    for name, w in weights.items():
        if not name.endswith("_proj.weight") or w.dim() != 2:
            continue
        *path, leaf, _ = name.split(".")
        parent = root
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = w.clone()
        parent.add_module(leaf, linear)
    return root


def write(base: Path, out: Path, name: str) -> None:
    weights = load_file(str(base / "model.safetensors"))
    model = linear_tree(weights)
    chosen = scheme_for(name)
    groups = chosen["config_groups"] or {"group_0": preset_name_to_scheme(chosen["scheme"], ["Linear"])}
    apply_quantization_config(model, QuantizationConfig(config_groups=groups))
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for linear in linears:
        initialize_observer(linear, "weight")
        observe(linear, "weight")
        update_qparams(linear, "weight")
        del linear.weight_observer
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    compressed = {k: v.contiguous() for k, v in model.state_dict().items()}
    kept = {k: v for k, v in weights.items() if not (k.endswith("_proj.weight") and v.dim() == 2)}
    save(base, out, {**kept, **compressed})
    compressor.update_config(str(out))

    # The oracle's weights: decompressed from what was saved, read back from the file.
    saved = load_file(str(out / "model.safetensors"))
    model.load_state_dict({k: saved[k] for k in compressed})
    compressor.decompress_model(model)
    dense = {k: v.contiguous() for k, v in model.state_dict().items() if k.endswith(".weight")}
    save(base, Path(f"{out}-dense"), {**kept, **dense})


def save(base: Path, out: Path, tensors: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((base / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for tokenizer_file in base.glob("tokenizer*"):
        shutil.copy(tokenizer_file, out)


def main() -> None:
    base, parent, *names = sys.argv[1:]
    for name in names:
        write(Path(base), Path(parent) / name, name)


if __name__ == "__main__":
    main()
