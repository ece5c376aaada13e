"""Microseconds per GGUF product with float activations beside x rounded to 8 bits (quantized_activations=int8; from
the GGUF blocks, and from the tile layout a loaded model's layers hold where the build has it), on this machine's
native build and its forced AVX2 build (`python -m strata.bench.int8_products` prints them)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from strata.bench.machine import cpu_model

# name -> STRATA_KERNEL_MARCH of the build measured (x86-64-v3: AVX2/FMA, the int8 path's vpmaddubsw kernels)
BUILDS = {"avx2": "x86-64-v3", "native": "native"}


def time_products(qtype_name: str, n: int, k: int, rows: tuple[int, ...], repeats: int) -> dict[str, float | str]:
    """Best microseconds of `repeats` calls of each (path, rows) in this process's build, the paths alternating, and
    the build's kernels ("build")."""
    import torch

    from strata.kernels.cpu import matmul as cpu_matmul
    from strata.layers.quantization import gguf_quants

    qtype = next(t for t, info in gguf_quants.TYPES.items() if info.name == qtype_name)
    info = gguf_quants.TYPES[qtype]
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (n, k // info.values_per_block * info.bytes_per_block), dtype=torch.uint8,
                         generator=generator)
    # random bytes, the first two fp16 fields (d and m of Q4_1, d and dmin of the K-quants) set to 2^-7
    data.view(-1, info.bytes_per_block)[:, :4] = torch.tensor([0, 0x20, 0, 0x20], dtype=torch.uint8)
    best: dict[str, float | str] = {}
    xs = {m: torch.randn(m, k, generator=generator) for m in rows}
    tiles = cpu_matmul.tile_for_int8(data, gguf_quants.kernel_kind(qtype), k)  # None: no tile layout here
    products = {"float": lambda x: gguf_quants.gguf_linear(x, data, qtype, k),
                "int8": lambda x: gguf_quants.gguf_linear(x, data, qtype, k, activations="int8")}
    if tiles is not None:  # what a loaded model's layers run with int8 activations
        products["int8-tiled"] = lambda x: gguf_quants.tiled_linear(x, tiles, qtype, k, n)
    for _ in range(repeats):
        for m, x in xs.items():
            for path, product in products.items():
                start = time.perf_counter()
                product(x)
                elapsed = (time.perf_counter() - start) * 1e6
                key = f"{path} {m}"
                best[key] = min(float(best.get(key, float("inf"))), elapsed)
    best["build"] = f"{cpu_matmul.instruction_set()}; int8: {cpu_matmul.int8_activations_set()}"
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--type", default="Q4_1")
    parser.add_argument("--n", type=int, default=576)
    parser.add_argument("--k", type=int, default=1536)
    parser.add_argument("--rows", default="1,64")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each build's process in turn")
    parser.add_argument("--repeats", type=int, default=20, help="calls of each product per round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    rows = tuple(int(r) for r in args.rows.split(","))
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(time_products(args.type, args.n, args.k, rows, args.repeats)))
        return
    best: dict[str, dict[str, float]] = {name: {} for name in BUILDS}
    builds: dict[str, str] = {}
    for _ in range(args.rounds):  # the machine may be shared: builds alternate, the best of every round kept
        for name, march in BUILDS.items():
            out = subprocess.run([sys.executable, "-m", "strata.bench.int8_products", "--child", *sys.argv[1:]],
                                 env={**os.environ, "STRATA_KERNEL_MARCH": march}, check=True, capture_output=True,
                                 text=True).stdout
            result = json.loads(out.splitlines()[-1])
            builds[name] = result.pop("build")
            for key, us in result.items():
                best[name][key] = min(best[name].get(key, float("inf")), us)
    print(f"CPU: {cpu_model()}; {args.threads} thread(s); {args.type} [{args.n} x {args.k}]; best of "
          f"{args.rounds} rounds x {args.repeats} calls, microseconds")
    for name in BUILDS:
        cells = "  ".join(f"{key}: {best[name][key]:.1f}" for key in sorted(best[name], key=lambda s: (
            int(s.split()[1]), s)))
        print(f"  {name} ({builds[name]}): {cells}")


if __name__ == "__main__":
    main()
