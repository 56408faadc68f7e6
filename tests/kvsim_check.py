"""The kvcache-simulator package's side of tests/simulate.rs (run with a Python that can
import it; the test skips otherwise).

  calc:  reads `mooncake calc --list --json` lines on stdin and checks each row's
         bytes per token, total bytes and linear-attention state against the package's
         calculator for the same model, precisions, draft setting and tokens; prints
         `ok N` or the mismatches and exits 1.
  sim TRACE BLOCK_TOKENS CAPACITIES POLICIES:
         the package's hit rates (last half) for those block capacities, one JSON line
         per (capacity, policy): its C++ backend when a C++ compiler is there (as its CLI
         defaults to), else its Python backend.
"""

import json
import shutil
import sys


def calc():
    from kvcache_sim.calculator import calculate_cache_size, load_models_data, models_by_id

    data = load_models_data()
    models = models_by_id(data)
    rows = [json.loads(line) for line in sys.stdin if line.strip()]
    bad = []
    for r in rows:
        model = models.get(r["model"])
        if model is None:
            bad.append(f"{r['model']}: not in the package's catalog")
            continue
        args = dict(
            tokens=r["tokens"],
            precision=r["precision"],
            indexer_precision=r["indexer_precision_asked"],
            block_size=512,
            include_draft_kv_cache=r["draft"],
            models_data=data,
        )
        theirs = calculate_cache_size(model, include_linear_attention_state=False, **args)
        for key, value in (("bytes_per_token", theirs.bytes_per_token), ("total_bytes", theirs.total_bytes)):
            if r[key] != value:
                bad.append(f"{r['model']} {r['precision']} idx={r['indexer_precision_asked']} draft={r['draft']} "
                           f"tokens={r['tokens']}: {key} ours {r[key]!r}, package {value!r}")
        with_state = calculate_cache_size(model, include_linear_attention_state=True, **args)
        state = with_state.total_bytes - theirs.total_bytes
        ours = r["state_bytes_per_sequence"] or 0.0
        if abs(ours - state) > 1e-9 * max(1.0, state):
            bad.append(f"{r['model']}: state ours {ours!r}, package {state!r}")
    # Every model the package can size must be in ours.
    ours_ids = {r["model"] for r in rows}
    for mid, model in models.items():
        if mid in ours_ids:
            continue
        try:
            calculate_cache_size(model, tokens=1024, models_data=data)
        except ValueError:
            continue  # a formula the package cannot compute either
        bad.append(f"{mid}: sized by the package, missing from our catalog")
    if bad:
        print("\n".join(bad))
        sys.exit(1)
    print(f"ok {len(rows)}")


def sim(trace, block_tokens, capacities, policies):
    from kvcache_sim.simulator import warmup_requests_for_trace
    from kvcache_sim.trace import parse_trace_file

    tr = parse_trace_file(trace, block_size=int(block_tokens))
    caps = [int(c) for c in capacities.split(",")]
    pols = policies.split(",")
    warmup = warmup_requests_for_trace(tr, 0.5)
    if shutil.which("c++"):
        from kvcache_sim.cpp_backend import run_cpp_sweep

        results = run_cpp_sweep(tr, capacities=caps, policies=pols, warmup_requests=warmup).results
        backend = "cpp"
    else:
        from kvcache_sim.plan import build_execution_plan
        from kvcache_sim.policies import simulate_policy

        plan = build_execution_plan(tr, warmup_fraction=0.5)
        results = {(p, c): simulate_policy(plan, p, c) for c in caps for p in pols}
        backend = "python"
    for (policy, cap), r in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(json.dumps({"capacity_blocks": cap, "policy": policy, "hit_rate_last_half": r.hitRate,
                          "hit_tokens_last_half": r.hitTokens, "mode": r.measurementMode,
                          "backend": backend}))


if __name__ == "__main__":
    if sys.argv[1] == "calc":
        calc()
    else:
        sim(*sys.argv[2:6])
