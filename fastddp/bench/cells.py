"""How the step benchmarks' rows read in their tables: a row's cells, and the sizes in the
titles (small models and payloads as counts and kB, not as "0.0M" and "0.0 MB")."""


def vs_fp32(r):
    return "-" if r["vs_fp32"] is None else f"{r['vs_fp32']:.2f}x"


def times(r):
    # The step time columns of the step benchmarks: p50, p90 and the ratio to fp32's p50.
    return [f"{r['p50_ms']:.1f}", f"{r['p90_ms']:.1f}", vs_fp32(r)]


def size(n):
    """Bytes in MB, or in kB below 0.1 MB (a small model's are not "0.0 MB")."""
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def plural(n, what):
    return f"{n} {what}{'' if n == 1 else 's'}"


def ddp(r):
    exposed = "-" if r["exposed_comm"] is None else f"{100 * r['exposed_comm']:.0f} %"
    return [
        r["mode"] if not r.get("chose") else f"{r['mode']} ({r['chose']})",
        *times(r),
        exposed,
        size(r["payload_bytes"]),
        size(r["cross_node_bytes"]),
        f"{r['cpu_s_per_step']:.2f} s",
    ]


def fsdp(r):
    err = "-" if r["grad_rel_err"] is None else f"{r['grad_rel_err']:.2e}"
    vs_hsdp = "-" if r["vs_hsdp"] is None else f"{r['vs_hsdp']:.2f}x"
    link = r["link_bytes_per_step"]
    link = "-" if link is None else size(link)
    sent = [size(r[k]) for k in ("rs_sent_bytes", "ag_sent_bytes")]
    cells = [r["mode"], *times(r), vs_hsdp, *sent, link, err]
    return [*cells, f"{r['loss']:.4f}"]


def convergence(r):
    # auto may reach the target (and stop) before its trial ends, with no plan to name
    plan = r.get("chose") or ("in its trial" if r["mode"] == "fastddp-auto" else None)
    return [
        r["mode"] if plan is None else f"{r['mode']} ({plan})",
        str(r["steps_to_target"]) if r["reached"] else f"not in {r['steps']}",
        f"{r['seconds_to_target']:.1f} s" if r["reached"] else "-",
        vs_fp32(r),
        f"{r['final_val_loss']:.3f}",
        size(r["wire_mb"] * 1e6),
        size(r["cross_node_mb"] * 1e6),
    ]


def hook_cost(r):
    per = "-" if r["per_bucket_us"] is None else f"{r['per_bucket_us']:.1f}"
    vs = "-" if r["vs_torch_fp16"] is None else f"{r['vs_torch_fp16']:.2f}x"
    return [r["mode"], f"{r['step_us']:.0f}", per, vs]


def millions(rows):
    n = rows[0]["params"]
    # Small models (tests, --params 10) read as counts, not as "0.0M".
    return f"{n / 1e6:.1f}M parameters" if n >= 100_000 else f"{n:,} parameters"
