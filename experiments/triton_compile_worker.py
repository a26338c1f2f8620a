"""Compile Triton-dialect (TTIR) files to sm_XX cubins with the pip `triton` package; no GPU needed.

Run by experiments/check_gpu_lowering.py under an interpreter that has `triton` (it imports nothing
else from this repository, so it can run from a separate virtual environment):

    TRITON_PYTHON experiments/triton_compile_worker.py jobs.json out.json

jobs.json: [{"name", "ttir_path", "num_warps", "num_stages", "capability"}]. For each job it writes the
cubin next to the TTIR and reports: shared memory bytes (Triton's metadata), and from the bundled
`ptxas -v` on Triton's PTX: registers per thread, stack frame, spill stores / loads (bytes). A failed
compile is reported with its error, not raised, so one bad kernel does not hide the others.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile


def _ptxas_usage(ptxas: str, ptx: str, arch: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        run = subprocess.run([ptxas, "-v", f"-arch={arch}", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    log = run.stdout + run.stderr
    if run.returncode:
        raise RuntimeError(f"ptxas failed: {log[-2000:]}")

    def grab(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    return {"registers": grab(r"Used (\d+) registers"), "stack_frame_bytes": grab(r"(\d+) bytes stack frame"),
            "spill_store_bytes": grab(r"(\d+) bytes spill stores"), "spill_load_bytes": grab(r"(\d+) bytes spill loads")}


def main(jobs_path: str, out_path: str) -> None:
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # XLA's Triton fuses multiply-adds
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas  # the ptxas Triton itself uses for that arch

    results = []
    for job in json.load(open(jobs_path)):
        cap = int(job["capability"])
        entry = {"name": job["name"], "triton_version": triton.__version__, "capability": cap}
        try:
            kernel = triton.compile(job["ttir_path"], target=GPUTarget("cuda", cap, 32),
                                    options={"num_warps": job["num_warps"], "num_stages": job["num_stages"]})
            with open(job["ttir_path"].replace(".ttir", ".cubin"), "wb") as f:
                f.write(kernel.asm["cubin"])
            entry.update(ok=True, shared_memory_bytes=int(kernel.metadata.shared),
                         **_ptxas_usage(get_ptxas(cap).path, kernel.asm["ptx"], f"sm_{cap}a" if cap >= 90 else f"sm_{cap}"))
        except Exception as e:  # noqa: BLE001 - reported per kernel
            entry.update(ok=False, error=f"{type(e).__name__}: {str(e)[-2000:]}")
        results.append(entry)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
