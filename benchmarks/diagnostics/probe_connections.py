"""The consumer's waiting against the number of hardware work queues CUDA gives the process
(``CUDA_DEVICE_MAX_CONNECTIONS``): streams beyond that many share a queue, and work in one queue runs in the
order it was queued, so a training step queued behind the loader's copies waits for them.

    python -m benchmarks.diagnostics.probe_connections [--settings default,1,2,4,32] [--repeats 2]

The variable is read when CUDA starts in a process, so each setting runs ``probe_floor`` (steps alone, a
list of batches on the device, the library; ``--backend`` mmap by default) in a process of its own, the
settings in turn, ``--repeats`` rounds, in reverse order every other round. ``default`` runs with the
variable unset (the driver's own count). Every row of ``probe_floor`` comes back with its setting and round.
GPU only. Writes ``results/<machine>/probe-connections[-TAG].json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from ..common import Rows, add_step_options, parse_probe_args, probe_parser, write_probe

VARIABLE = "CUDA_DEVICE_MAX_CONNECTIONS"


def environment(setting: str, base: dict[str, str]) -> dict[str, str]:
    """``base`` with the variable set to ``setting``, or removed for ``default`` (a value the caller's
    environment holds must not leak into the default's row)."""
    env = {k: v for k, v in base.items() if k != VARIABLE}
    if setting != "default":
        if not setting.isdigit() or int(setting) < 1:
            raise ValueError(f"a setting is 'default' or a positive count of queues (found {setting!r})")
        env[VARIABLE] = setting
    return env


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__.splitlines()[0])
    add_step_options(ap)
    ap.add_argument("--settings", default="default,1,2,4,32")
    ap.add_argument("--variants", default="alone,list,base")
    ap.add_argument("--backend-options", default=None, help="passed on to probe_floor (JSON)")
    ap.add_argument("--label", default=None, help="recorded with every row (what the options are for)")
    args = parse_probe_args(ap, argv)
    settings = args.settings.split(",")
    for s in settings:
        environment(s, {})  # a bad setting fails before anything runs
    rows = Rows()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for s in settings if r % 2 == 0 else settings[::-1]:
                tag = f"{s}-{r}"
                cmd = [sys.executable, "-m", "benchmarks.diagnostics.probe_floor", "--variants", args.variants,
                       "--backend", args.backend, "--factor", str(args.factor), "--passes", str(args.passes),
                       "--repeats", "1", "--data", args.data, "--size-gib", str(args.size_gib), "--out", tmp,
                       "--tag", tag] + (["--backend-options", args.backend_options] if args.backend_options else [])
                done = subprocess.run(cmd, env=environment(s, dict(os.environ)), capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"probe_floor with {VARIABLE} {s} failed ({done.returncode}):\n"
                                       f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
                path = next(os.path.join(d, f) for d, _, fs in os.walk(tmp) for f in fs
                            if f == f"probe-floor-{tag}.json")
                with open(path) as f:
                    for row in json.load(f)["results"]:
                        rows.emit({"connections": s, "round": r, "label": args.label,
                                   "backend_options": args.backend_options, **row})
    print("wrote", write_probe(args, "probe-connections", rows, variable=VARIABLE, settings=settings), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
