"""Decompress a compressed-tensors checkpoint with the library's own compressors into a dense one that transformers
loads as it is (run in llm-compressor's environment, by subprocess): the oracle's weights, independent of strata.

usage: python decompress_checkpoint.py QUANTIZED_FOLDER DENSE_FOLDER [QUANTIZED_FOLDER DENSE_FOLDER ...]
(several pairs in one process: importing the libraries takes longer than decompressing a test checkpoint)
Per-expert Llama 4 tensors (`experts.{e}.gate_proj.weight`, ...) are fused back into transformers' expert
layout (`experts.gate_up_proj` [E, H, 2I], `experts.down_proj` [E, I, H]).
"""
import json
import re
import shutil
import sys
from pathlib import Path

import torch
from compressed_tensors.compressors.base import BaseCompressor
from compressed_tensors.quantization import QuantizationConfig
from safetensors.torch import load_file, save_file


def decompress(tensors: dict[str, torch.Tensor], config: QuantizationConfig) -> dict[str, torch.Tensor]:
    [scheme] = config.config_groups.values()  # the test checkpoints use one group
    compressor = BaseCompressor.get_value_from_registry(config.format)
    modules = {name[: -len(".weight_packed")] for name in tensors if name.endswith(".weight_packed")}
    dense = {name: t for name, t in tensors.items() if name.rpartition(".")[0] not in modules}
    for module in modules:
        local = {name[len(module) + 1:]: t for name, t in tensors.items() if name.rpartition(".")[0] == module}
        dense[module + ".weight"] = compressor.decompress(local, scheme)["weight"].float()
    return dense


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    per_expert = re.compile(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out = {}
    for name, t in tensors.items():
        match = per_expert.match(name)
        if match:
            experts.setdefault(match[1], {})[(int(match[2]), match[3])] = t
        else:
            out[name] = t
    for stem, parts in experts.items():
        count = 1 + max(e for e, _ in parts)
        out[stem + ".gate_up_proj"] = torch.stack([torch.cat([parts[e, "gate"], parts[e, "up"]]).T
                                                   for e in range(count)]).contiguous()
        out[stem + ".down_proj"] = torch.stack([parts[e, "down"].T for e in range(count)]).contiguous()
    return out


def main() -> None:
    folders = list(map(Path, sys.argv[1:]))
    if not folders or len(folders) % 2:
        raise SystemExit(__doc__)
    for src, dst in zip(folders[::2], folders[1::2], strict=True):
        decompress_folder(src, dst)


def decompress_folder(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    quant = QuantizationConfig.model_validate(config.pop("quantization_config"))
    tensors = fuse_experts(decompress(load_file(str(src / "model.safetensors")), quant))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))


if __name__ == "__main__":
    main()
