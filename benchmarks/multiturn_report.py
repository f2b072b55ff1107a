"""What a multi-turn run means: per-turn medians, ratios to no connector, token identity, plot.

Kept apart from the workload so the numbers can be recomputed from a saved JSON (``--replot``)
without a server.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.multiturn_server import ConnectorSettings, ServerSettings
    from benchmarks.multiturn_workload import Workload

BASELINE = "no_connector"
# The second yardstick of issue 17: vLLM's own offloading connector at its defaults.
NATIVE = "native_offload"


class RunStatus(Enum):
    COMPLETED = "completed"
    REFUSED = "refused"  # the configuration does not start here (expected: native offload on CPU)
    FAILED = "failed"  # it should have started or finished and did not


@dataclass(frozen=True)
class Mismatch:
    """A turn whose generated tokens differ from the reference configuration's."""

    config: str
    conversation: int
    turn: int
    first_diff_index: int
    reference_len: int
    got_len: int
    follows_earlier_mismatch: bool  # the prompt itself already differed (earlier turn)

    def as_json(self) -> dict[str, Any]:
        return self.__dict__.copy()


def _p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def turn_table(records: list[dict[str, Any]], rounds: list[dict[str, int]]) -> dict[str, Any]:
    """Per turn index: TTFT stats, cached tokens (usage), and the round's counter deltas."""
    out: dict[int, Any] = {}
    for turn in sorted({r["turn"] for r in records}):
        rows = [r for r in records if r["turn"] == turn]
        ttft = [r["ttft_s"] for r in rows]
        whole = [r["e2e_s"] for r in rows]
        cached = [r["cached_tokens"] for r in rows if r["cached_tokens"] is not None]
        prompt = [r["prompt_tokens"] for r in rows]
        server_ttft = [r["server_ttft_ms"] for r in rows if r.get("server_ttft_ms") is not None]
        counters = rounds[turn - 1] if turn - 1 < len(rounds) else {}
        if len(cached) != len(rows):
            # No usage field: fall back to the round's counters (device + connector hits).
            hits = counters.get("local_hits", 0) + counters.get("external_hits", 0)
            cached, source = [hits / len(rows)], "metrics_round_mean"
        else:
            source = "usage"
        out[str(turn)] = {
            "n": len(rows),
            "ttft_median_s": _r(statistics.median(ttft)),
            "ttft_mean_s": _r(statistics.fmean(ttft)),
            "ttft_p90_s": _r(_p90(ttft)),
            # The whole turn, request sent to last token: what a chat user waits for.
            "turn_median_s": _r(statistics.median(whole)),
            "decode_median_s": _r(
                statistics.median(e - t for e, t in zip(whole, ttft, strict=True))
            ),
            "server_ttft_median_ms": _r(statistics.median(server_ttft), 1) if server_ttft else None,
            "prompt_tokens_median": statistics.median(prompt),
            "cached_tokens_median": statistics.median(cached),
            "cached_fraction_median": _r(
                statistics.median(c / p for c, p in zip(cached, prompt, strict=False)), 3
            ),
            "cached_tokens_source": source,
            **{f"round_{k}": v for k, v in counters.items()},
        }
    return out


def throughput(records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    prompt = sum(r["prompt_tokens"] for r in records)
    output = sum(len(r["output_token_ids"]) for r in records)
    cached = sum(r["cached_tokens"] or 0 for r in records)
    return {
        "wall_s": round(wall_s, 2),
        "requests": len(records),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cached_prompt_tokens": cached,
        "total_tokens_per_s": round((prompt + output) / wall_s, 1),
        "output_tokens_per_s": round(output / wall_s, 2),
        "computed_prompt_tokens_per_s": round((prompt - cached) / wall_s, 1),
    }


def ttft_ratios(configs: dict[str, Any], goal: float) -> dict[str, Any]:
    """Median TTFT of each connector configuration over no connector's, turns >= 2."""
    base = configs.get(BASELINE, {})
    if base.get("status") != RunStatus.COMPLETED.value:
        return {}
    base_recs = [r for r in base["records"] if r["turn"] >= 2]
    out: dict[str, Any] = {}
    for name, cfg in configs.items():
        if name == BASELINE or cfg.get("status") != RunStatus.COMPLETED.value:
            continue
        recs = [r for r in cfg["records"] if r["turn"] >= 2]
        if not recs or not base_recs:
            continue
        per_turn, computed = {}, {}
        for turn in sorted({r["turn"] for r in recs}):
            a = statistics.median(r["ttft_s"] for r in recs if r["turn"] == turn)
            b = statistics.median(r["ttft_s"] for r in base_recs if r["turn"] == turn)
            per_turn[str(turn)] = round(a / b, 3)
            computed[str(turn)] = _computed_ratio(
                [r for r in recs if r["turn"] == turn], [r for r in base_recs if r["turn"] == turn]
            )
        pooled = statistics.median(r["ttft_s"] for r in recs) / statistics.median(
            r["ttft_s"] for r in base_recs
        )
        out[name] = {
            "per_turn": per_turn,
            "turns_ge2_pooled": round(pooled, 3),
            # Prompt tokens computed (not cached) over no connector's: what the TTFT ratio
            # would be if prefill time were proportional to them; immune to background load.
            "computed_tokens_per_turn": computed,
            "computed_tokens_turns_ge2": _computed_ratio(recs, base_recs),
            "worst_turn": max(per_turn.values()),
            "goal": goal,
            "goal_met": pooled <= goal and max(per_turn.values()) <= goal,
        }
    return out


def turn_ratios(configs: dict[str, Any]) -> dict[str, Any]:
    """Turns >= 2, each configuration against no connector and against native offloading:
    median TTFT ratio and median whole-turn ratio (pooled over the turns)."""

    def medians(cfg: dict[str, Any]) -> tuple[float, float] | None:
        if cfg.get("status") != RunStatus.COMPLETED.value:
            return None
        recs = [r for r in cfg["records"] if r["turn"] >= 2]
        if not recs:
            return None
        return statistics.median(r["ttft_s"] for r in recs), statistics.median(
            r["e2e_s"] for r in recs
        )

    bases = {b: medians(configs[b]) for b in (BASELINE, NATIVE) if b in configs}
    out: dict[str, Any] = {}
    for name, cfg in configs.items():
        mine = medians(cfg)
        if mine is None:
            continue
        row: dict[str, Any] = {"ttft_median_s": _r(mine[0]), "turn_median_s": _r(mine[1])}
        for b, theirs in bases.items():
            if theirs is not None and b != name:
                row[f"ttft_vs_{b}"] = _r(mine[0] / theirs[0], 3)
                row[f"turn_vs_{b}"] = _r(mine[1] / theirs[1], 3)
        out[name] = row
    return out


def render_turn_ratios(ratios: dict[str, Any]) -> str:
    """Issue 17's end-to-end table: TTFT and whole-turn time at turns >= 2."""
    lines = [
        "| config | TTFT median s | turn median s | TTFT x none | turn x none "
        "| TTFT x native | turn x native |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in ratios.items():
        cells = [
            r.get(k, "-")
            for k in (
                f"ttft_vs_{BASELINE}",
                f"turn_vs_{BASELINE}",
                f"ttft_vs_{NATIVE}",
                f"turn_vs_{NATIVE}",
            )
        ]
        lines.append(
            f"| {name} | {r['ttft_median_s']} | {r['turn_median_s']} | "
            + " | ".join(str(c) for c in cells)
            + " |"
        )
    return "\n".join(lines)


def _computed_ratio(recs: list[dict[str, Any]], base: list[dict[str, Any]]) -> float | None:
    def computed(rows: list[dict[str, Any]]) -> int:
        return sum(r["prompt_tokens"] - (r["cached_tokens"] or 0) for r in rows)

    b = computed(base)
    return round(computed(recs) / b, 3) if b else None


def token_mismatches(configs: dict[str, Any]) -> tuple[str | None, list[Mismatch]]:
    """Compare every completed configuration's outputs, turn by turn, to the first one's."""
    done = [n for n, c in configs.items() if c.get("status") == RunStatus.COMPLETED.value]
    if not done:
        return None, []
    ref_name = BASELINE if BASELINE in done else done[0]
    ref = {
        (r["conversation"], r["turn"]): r["output_token_ids"] for r in configs[ref_name]["records"]
    }
    found: list[Mismatch] = []
    for name in done:
        if name == ref_name:
            continue
        diverged: set[int] = set()
        recs = sorted(configs[name]["records"], key=lambda r: (r["conversation"], r["turn"]))
        seen = set()
        for r in recs:
            key = (r["conversation"], r["turn"])
            seen.add(key)
            want, got = ref.get(key), r["output_token_ids"]
            if want == got:
                continue
            want = want or []
            idx = next(
                (i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
                min(len(want), len(got)),
            )
            found.append(
                Mismatch(name, key[0], key[1], idx, len(want), len(got), key[0] in diverged)
            )
            diverged.add(key[0])
        for key in sorted(set(ref) - seen):
            found.append(Mismatch(name, key[0], key[1], 0, len(ref[key]), 0, key[0] in diverged))
    return ref_name, found


def render_table(summary: dict[str, Any]) -> str:
    """The per-turn table printed at the end of a run (and pasted into BENCHMARKS.md)."""
    configs = summary["configs"]
    ratios = summary.get("ttft_ratio_vs_no_connector", {})
    lines = [
        "| config | turn | prompt tok | cached tok (median) | local / external hits (round) "
        "| TTFT median s | p90 s | x no-connector |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, cfg in configs.items():
        if cfg["status"] != RunStatus.COMPLETED.value:
            lines.append(
                f"| {name} | - | - | - | - | {cfg['status']}: {cfg.get('message', '')} | | |"
            )
            continue
        for turn, row in cfg["turns"].items():
            ratio = ratios.get(name, {}).get("per_turn", {}).get(turn)
            lines.append(
                f"| {name} | {turn} | {row['prompt_tokens_median']:.0f} "
                f"| {row['cached_tokens_median']:.0f} "
                f"| {row.get('round_local_hits', '-')} / {row.get('round_external_hits', '-')} "
                f"| {row['ttft_median_s']:.3f} | {row['ttft_p90_s']:.3f} "
                f"| {'' if ratio is None else f'{ratio:.3f}'} |"
            )
    lines.append("")
    lines.append(
        "| config | status | wall s | tokens/s (prompt+output) | output tok/s "
        "| TTFT ratio turns>=2 | 1-min load avg (before, after) per repeat |"
    )
    lines.append("|---|---|---|---|---|---|---|")
    for name, cfg in configs.items():
        tp = cfg.get("throughput") or {}
        rr = ratios.get(name, {})
        pooled = rr.get("turns_ge2_pooled")
        lines.append(
            f"| {name} | {cfg['status']} | {tp.get('wall_s', '-')} "
            f"| {tp.get('total_tokens_per_s', '-')} | {tp.get('output_tokens_per_s', '-')} "
            f"| {'' if pooled is None else pooled} "
            f"| {' / '.join(str(x) for x in cfg.get('load_avg_1min', [])) or '-'} |"
        )
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    """TTFT per turn per configuration (median line, every request as a dot), cached share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    refused = []
    for i, (name, cfg) in enumerate(summary["configs"].items()):
        if cfg["status"] != RunStatus.COMPLETED.value:
            refused.append(f"{name}: {cfg['status']}")
            continue
        color = f"C{i}"
        turns = [int(t) for t in cfg["turns"]]
        med = [row["ttft_median_s"] for row in cfg["turns"].values()]
        frac = [row["cached_fraction_median"] for row in cfg["turns"].values()]
        dx = (i - 1.5) * 0.06
        ax.scatter(
            [r["turn"] + dx for r in cfg["records"]],
            [r["ttft_s"] for r in cfg["records"]],
            s=10, alpha=0.35, color=color,
        )  # fmt: skip
        style = ["-", "--", "-.", ":"][i % 4]  # equal lines stay visible
        ax.plot(turns, med, marker="o", color=color, linestyle=style, label=name)
        ax2.plot(turns, frac, marker="o", color=color, linestyle=style, label=name)
    w = summary["workload"]
    ax.set_title(
        f"TTFT per turn ({w['conversations']} conv x {w['turns']} turns, "
        f"{w['clients']} clients, last prompt {w['final_prompt_tokens']} tok)"
    )
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token, s (line: median)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax2.set_title("cached share of the prompt (median)")
    ax2.set_xlabel("turn")
    ax2.set_ylim(0, 1.05)
    ax2.grid(alpha=0.3)
    if refused:
        ax2.text(0.02, 0.02, "\n".join(refused)[:300], transform=ax2.transAxes, fontsize=7)
    for a in (ax, ax2):
        a.set_xticks(
            sorted({int(t) for c in summary["configs"].values() for t in c.get("turns", {})})
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(
    configs: dict[str, dict[str, Any]],
    w: Workload,
    s: ServerSettings,
    c: ConnectorSettings,
    device: dict[str, Any] | None,
    goal: float,
) -> dict[str, Any]:
    """The run's JSON summary: workload, server, device cache, per-configuration results,
    the ratios the goals are judged on, and whether every configuration's tokens agree."""
    ref, mismatches = token_mismatches(configs)
    working_set = w.system_tokens + w.conversations * (
        w.final_prompt_tokens() + w.output_tokens - w.system_tokens
    )
    return {
        "workload": {
            **asdict(w),
            "final_prompt_tokens": w.final_prompt_tokens(),
            "repeats": max((len(c.get("runs", [])) for c in configs.values()), default=0),
        },
        "server": {
            "model": str(s.model),
            "max_model_len": s.max_model_len,
            "max_num_seqs": s.max_num_seqs,
            "device_blocks": s.device_blocks,
            "engine_args": list(s.engine_args),
        },
        "device_cache": {
            **(device or {}),
            "working_set_tokens": working_set,
            "holds_share_of_working_set": (
                round(device["kv_cache_size_tokens"] / working_set, 3) if device else None
            ),
        },
        "connector": {**asdict(c), "storage_dir": str(c.storage_dir)},
        "configs": {
            name: {k: v for k, v in cfg.items() if k not in ("records",)}
            for name, cfg in configs.items()
        },
        "ttft_ratio_vs_no_connector": ttft_ratios(configs, goal),
        "turn_ratios": turn_ratios(configs),
        "tokens_reference": ref,
        "tokens_identical": not mismatches,
        "mismatches": [m.as_json() for m in mismatches],
        "machine": {"nproc": os.cpu_count(), "threads": os.environ.get("OMP_NUM_THREADS")},
    }
