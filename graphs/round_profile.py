"""Where a decoding round's time goes: torch.profiler over one request's rounds, per round by op
(the skinny GEMMs, attention, the compiled graph's own time, Dynamo's guard checks, ...).

    FASTSPEC_DATA=../shared/data/benchmarks python -m fastspec.graphs.round_profile --weights bf16 --method linear
    python -m fastspec.graphs.round_profile --method ar --kernels      # inductor's kernels by name too

The request is the first GSM8K prompt (chat-rendered, greedy, EOS ignored); two unprofiled runs
first (compile and warm), then one profiled. --kernels sets inductor's cpp.enable_kernel_profile
(a recompile: its kernels then show by name, at some profiling cost)."""
from __future__ import annotations

import argparse


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="fp32", choices=("fp32", "bf16", "int8"))
    ap.add_argument("--method", default="linear")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--top", type=int, default=15, help="ops to list")
    ap.add_argument("--kernels", action="store_true", help="name inductor's generated kernels")
    a = ap.parse_args(argv)
    import torch
    if a.kernels:
        import torch._inductor.config as inductor_config
        inductor_config.cpp.enable_kernel_profile = True
    from torch.profiler import ProfilerActivity, profile

    from fastspec.cli.main import load_engine
    from fastspec.evals.data import load_benchmark
    from fastspec.sampling import SamplingParams

    engine = load_engine(a.model, "float32", "auto", weights=a.weights)
    prompt = [engine.render_chat([{"role": "user", "content": load_benchmark("gsm8k")[0].question}])]
    params = SamplingParams(max_new_tokens=a.max_new_tokens, ignore_eos=True)
    for _ in range(2):
        engine.generate(prompt, params, method=a.method)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate(prompt, params, method=a.method)
    st = engine.last_stats
    print(f"{a.method}, {a.weights} weights, {torch.get_num_threads()} threads: {st.rounds} rounds, "
          f"{st.decode_s * 1e3 / st.rounds:.2f} ms a round (profiled)")
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[: a.top]
    for e in rows:
        print(f"{e.self_cpu_time_total / st.rounds / 1e3:8.3f} ms {e.count / st.rounds:7.1f} calls a round  {e.key[:80]}")


if __name__ == "__main__":
    main()
