"""Calibrate the performance model's per-op efficiencies on cited public tables (issue 19, item 3).

    python -m experiments.calibrate --out results/calibration

Fits each op family's few parameters on half of a published table's rows and reports the error on
the other half (glm53/perfmodel/calibration.py says the models; glm53/perfmodel/published.json and
docs/perfmodel_sources.md the sources). Writes OUT/gemm.json. So far only FP8 GEMMs; the simulator does
not use the fitted values yet.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from experiments.common import cpu_name, git_revision
from glm53.perfmodel.calibration import calibrate_gemm


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m experiments.calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/calibration")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = calibrate_gemm()
    res.update(date=time.strftime("%Y-%m-%d"), git_revision=git_revision(),
               machine={"cpu": cpu_name(), "cpu_count": os.cpu_count()})
    (out / "gemm.json").write_text(json.dumps(res, indent=1))
    f = res["fit"]
    print(f"FP8 GEMM (DeepGEMM, H800): compute_eff {f['compute_eff']:.2f}, memory_eff {f['memory_eff']:.2f}, "
          f"launch {f['launch_s'] * 1e6:.1f} us; holdout |error| mean {res['holdout_mean_abs_rel_error']:.1%}, "
          f"max {res['holdout_max_abs_rel_error']:.1%} ({len(res['holdout_rows'])} rows)")
    print(f"wrote {out / 'gemm.json'}")
    return res


if __name__ == "__main__":
    main()
