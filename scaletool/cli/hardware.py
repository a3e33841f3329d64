"""``scaletool hardware``: the accelerator profiles behind MFU and decoding bandwidth, and how to add one."""
from __future__ import annotations

import os

import click

from scaletool.cli.options import console, deliver, json_option

EXAMPLE_PROFILE = """\
name: RTX 4090
device: cuda
match: ["RTX 4090"]              # substrings of torch.cuda.get_device_name()
exclude: []                      # substrings that rule a name out (optional)
peak_tflops: {bf16: 165.2, fp16: 165.2, fp32: 82.6}   # dense, per dtype
peak_bandwidth_gb_s: 1008        # device memory (optional)
memory_gib: 23.99                # one device's memory (optional; plan)
# power_limit_w: 500             # the board's limit, with power_curve: gh100 for an H100/H200/H800 (optional):
# power_curve: gh100             #   under 700 W the default GEMM/attention rates slow with the clock it leaves
reference: "NVIDIA Ada architecture whitepaper, dense, fp32 accumulate"
"""


def _machine_line(res) -> str:
    m = res.this_machine
    where = m.device_name if m.device == "cuda" else "CPU"
    if m.device_count:
        where += f" (cuda, {m.device_count} device{'s' if m.device_count > 1 else ''})"
    prof = next((p for p in res.profiles if p.name == m.profile), None)
    if prof is None:
        return (f"this machine: {where}: no profile matches it, so MFU is null; add a profile (below) or pass "
                "--peak-tflops to train")
    peaks = ", ".join(f"{v:g} TFLOP/s {k}" for k, v in prof.peak_tflops.items()) or "no peak assumed (MFU is null "\
        "unless --peak-tflops gives one)"
    return f"this machine: {where} -> profile {prof.name} ({prof.source}): {peaks}"


#: The console width from which the profiles are one table; narrower, each is a few wrapped lines.
WIDE = 120


def _names(p) -> str:
    return ", ".join(p.match) + (f" (not {', '.join(p.exclude)})" if p.exclude else "")


def _table(profiles):
    from rich.markup import escape
    from rich.table import Table

    t = Table()
    for col, kw in (("profile", {}), ("device", {}), ("matches GPU names with", {"overflow": "fold"}),
                    ("bf16", {"justify": "right"}), ("fp16", {"justify": "right"}), ("fp32", {"justify": "right"}),
                    ("HBM TB/s", {"justify": "right"}), ("source", {"overflow": "fold"})):
        t.add_column(col, **kw)
    for p in profiles:
        bw = f"{p.peak_bandwidth_bytes_per_s / 1e12:.2f}" if p.peak_bandwidth_bytes_per_s else "-"
        t.add_row(escape(p.name), p.device, escape(_names(p) or "any CPU"),
                  *(f"{p.peak_tflops[d]:g}" if d in p.peak_tflops else "-" for d in ("bf16", "fp16", "fp32")),
                  bw, escape(p.source + (f" (replaces {p.replaces})" if p.replaces else ""))
                  + (f"\n[dim]{escape(p.reference)}[/]" if p.reference else ""))
    return t


def _compact(p, width: int) -> str:
    """One profile as a head line and ``key: value`` lines, wrapped at word boundaries to ``width``."""
    import textwrap

    peaks = ", ".join(f"{d} {p.peak_tflops[d]:g}" for d in ("bf16", "fp16", "fp32") if d in p.peak_tflops)
    head = f"{p.name} ({p.device}): " + (f"{peaks} TFLOP/s" if peaks else "no peak")
    if p.peak_bandwidth_bytes_per_s:
        head += f"; HBM {p.peak_bandwidth_bytes_per_s / 1e12:.2f} TB/s"
    fields = [("matches", _names(p) or "any CPU"),
              ("source", p.source + (f" (replaces {p.replaces})" if p.replaces else "")),
              ("reference", p.reference)]
    lines = textwrap.wrap(head, width, subsequent_indent="    ", break_long_words=False, break_on_hyphens=False)
    for key, value in fields:
        if value:
            lines += textwrap.wrap(f"{key}: {value}", width, initial_indent="  ", subsequent_indent="    ",
                                   break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines)


def _print(res) -> None:
    from rich.markup import escape

    from scaletool.measure.hardware import PROFILES_ENV

    con = console()
    con.print("Accelerator profiles, in matching order (dense peak TFLOP/s; user profiles first):", highlight=False)
    if con.width >= WIDE:
        con.print(_table(res.profiles))
    else:  # a narrow terminal: a table of eight columns would fold words mid-way
        for p in res.profiles:
            con.print(escape(_compact(p, con.width)), highlight=False)
    con.print(escape(_machine_line(res)), highlight=False)
    env = os.environ.get(PROFILES_ENV)
    con.print("\nTo add a profile, or replace a shipped one (same name), write a YAML file like the one below "
              f"to a directory named in ${PROFILES_ENV} (os.pathsep-separated; "
              + (f"now {escape(env)!r})" if env else "not set)") + " or to "
              + escape(res.user_dirs[-1]) + ":", highlight=False)
    con.print("\n" + "\n".join(f"  {ln}" for ln in escape(EXAMPLE_PROFILE).splitlines()), highlight=False)
    con.print("then run `scaletool hardware` again: it validates every file (one error line per problem).",
              highlight=False)


@click.command()
@click.option("--device-name", metavar="NAME", help="Say which profile a GPU of this name would get (the name as "
              "torch.cuda.get_device_name() gives it; 'cpu' for a CPU) instead of this machine's.")
@json_option
def hardware(device_name: str | None, as_json: bool):
    """List the accelerator profiles (dense bf16/fp16/fp32 peaks, memory bandwidth, source), say which
    one this machine matches, and how to add one.

    MFU divides achieved FLOP/s by the matched profile's dense peak; decode divides its bytes per
    step by the peak bandwidth. Profiles ship with scaletool (profiles/*.yaml); yours go in
    $SCALETOOL_PROFILES or ~/.config/scaletool/profiles and extend or replace them. A GH100 card
    held under 700 W (power_limit_w, power_curve: gh100) is predicted at the clock its limit leaves.

    \b
    Examples:
      scaletool hardware
      scaletool hardware --device-name "NVIDIA H100 80GB HBM3" --json
    """
    from scaletool import api

    res = api.hardware(device_name)
    deliver(res, as_json)
    if not as_json:
        _print(res)
    return res
