"""What a step's compile options cost: one method's decode step compiled twice in one process, as the
runner compiles it and another way, called in alternated blocks on the same inputs.

    python -m fastspec.graphs.guard_ab --weights int8 --method ar --out results/guard_ab_int8_ar.json
    python -m fastspec.graphs.guard_ab --weights int8 --method ar --against whole-cpp

--against: all-guards (default: Dynamo's guards on every weight too, FASTSPEC_WEIGHT_GUARDS=1),
whole (the 30 layers traced into one graph instead of one nested region reused by every layer,
FASTSPEC_REGIONAL=0), whole-cpp (that graph with inductor's C++ wrapper, which cannot codegen a
nested region: the only way to drop the Python wrapper's per-kernel calls).
The step is the last non-prefill step a short greedy request ran (a 64-token prompt, 24 new
tokens). Reported: each side's median ms a call, the per-block paired difference (median and
quartiles) and whether the two steps' outputs are bit-identical on the same inputs."""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

# The other side: environment for the runner's compile, inductor config patches.
AGAINST = {"all-guards": ({"FASTSPEC_WEIGHT_GUARDS": "1"}, {}),
           "whole": ({"FASTSPEC_REGIONAL": "0"}, {}),
           "whole-cpp": ({"FASTSPEC_REGIONAL": "0"}, {"cpp_wrapper": True})}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="fp32", choices=("fp32", "bf16", "int8"))
    ap.add_argument("--method", default="ar")
    ap.add_argument("--blocks", type=int, default=40, help="alternated blocks per side")
    ap.add_argument("--calls", type=int, default=8, help="calls per block")
    ap.add_argument("--against", default="all-guards", choices=tuple(AGAINST))
    ap.add_argument("--out", help="results JSON")
    a = ap.parse_args(argv)
    from fastspec.cli.main import load_engine
    from fastspec.files import write_json
    from fastspec.graphs.profile import run_environment
    from fastspec.sampling import SamplingParams

    engine = load_engine(a.model, "float32", "auto", weights=a.weights)
    runner, seen, run = engine.runner, {}, engine.runner.run

    def spy(key, fn, *inputs, static=()):
        seen[key] = (fn, [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs])
        return run(key, fn, *inputs, static=static)

    runner.run = spy
    engine.generate([list(range(1, 65))], SamplingParams(max_new_tokens=24, ignore_eos=True), method=a.method)
    runner.run = run
    key = [k for k in seen if "prefill" not in str(k) and runner._entries.get(k) is not None
           and runner._entries[k].compiled is not None][-1]
    fn, inputs = seen[key]
    other = a.against
    steps = {"runner": runner._entries[key].compiled}
    env, patches = AGAINST[other]
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        import torch._inductor.config as inductor_config
        with inductor_config.patch(patches), torch.no_grad():
            steps[other] = runner._compile(key, "compile", fn)
            steps[other](*[t.clone() if isinstance(t, torch.Tensor) else t for t in inputs])   # compiles here
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v

    def fresh():
        return [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]

    times: dict[str, list[float]] = {name: [] for name in steps}
    with torch.no_grad():
        outs = {name: f(*fresh()) for name, f in steps.items()}
        same = all(torch.equal(x, y) for x, y in zip(*(o if isinstance(o, tuple) else (o,)
                                                       for o in outs.values())))
        args = fresh()
        for b in range(a.blocks):
            order = list(steps) if b % 2 == 0 else list(reversed(steps))     # neither side always first
            for name in order:
                for _ in range(a.calls):
                    t0 = time.perf_counter()
                    steps[name](*args)
                    times[name].append(time.perf_counter() - t0)
    block = {name: [statistics.median(ts[i:i + a.calls]) for i in range(0, len(ts), a.calls)]
             for name, ts in times.items()}
    diff = sorted(1e3 * (y - x) for x, y in zip(block["runner"], block[other]))
    result = {name: round(1e3 * statistics.median(ts), 3) for name, ts in times.items()}
    row = {"key": str(key), "method": a.method, "weights": a.weights, "against": other,
           "runner_ms": result["runner"], "other_ms": result[other],
           "saved_ms_median": round(statistics.median(diff), 3),
           "saved_ms_quartiles": [round(diff[len(diff) // 4], 3), round(diff[3 * len(diff) // 4], 3)],
           "bit_identical": bool(same), "blocks": a.blocks, "calls": a.calls}
    print(f"{key}: the runner's step {row['runner_ms']:.3f} ms, {other} {row['other_ms']:.3f} ms a call; "
          f"the runner's saves per block {row['saved_ms_median']:.3f} ms (quartiles {row['saved_ms_quartiles'][0]:.3f} .. "
          f"{row['saved_ms_quartiles'][1]:.3f}); outputs bit-identical: {row['bit_identical']}")
    if a.out:
        env = run_environment("cpu", torch.float32, "compile", a.weights, engine.model)
        env["command"] = (f"python -m fastspec.graphs.guard_ab --weights {a.weights} --method {a.method} "
                          f"--against {other} --blocks {a.blocks} --calls {a.calls}")
        write_json(a.out, {"environment": env, "rows": [row]})


if __name__ == "__main__":
    main()
