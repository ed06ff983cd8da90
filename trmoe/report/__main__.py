"""`python -m trmoe.report <run dir | multirun dir> ... [--control "arm=..."] [--out DIR]`

Reads every run under the given directories and writes report.md, report.csv, report_pairs.csv and
plots/*.png next to them (the one directory given, else the deepest directory holding them all), and prints
the Markdown. The control arm defaults to the one the grid names (hydra.callbacks.report.control), else the
only dense arm, else the first arm. Exit code 2, one line and nothing written, when there is nothing to
report or an argument is bad (--out is a file, --peak-tflops, --margin, --accuracy-margin or --target-loss
not a positive number, --control no arm's). With a control, report.md's Verdicts: TOST equivalence within
--margin (Holm-corrected), the effective speed-up and the time to --target-loss (trmoe.report.verdicts).
"""

from __future__ import annotations

import sys
from pathlib import Path

from trmoe.cli import Parser, run
from trmoe.report.build import REPORT_MD, build_report, parse_peak
from trmoe.report.ladder import DEFAULT_N, MIN_SAMPLES, N_KINDS, Options, parse_scaling
from trmoe.report.scaling_targets import DEFAULT_TARGETS
from trmoe.report.verdicts import DEFAULT_ACCURACY_MARGIN, DEFAULT_MARGIN, parse_positive
from trmoe.report.verdicts import Options as VerdictOptions


def main(argv: list[str] | None = None) -> int:
    return run(_main, argv)


def _main(argv: list[str]) -> int:
    parser = Parser(prog="python -m trmoe.report", description=__doc__.split("\n\n")[1])
    parser.add_argument("paths", nargs="+", type=Path, help="run directories or multirun directories")
    parser.add_argument(
        "--out", type=Path, default=None, help="write the report here (default: next to the runs)"
    )
    parser.add_argument(
        "--control", default=None, help='the arm to compare against, as its swept overrides: "arm=topk/dense"'
    )
    parser.add_argument(
        "--peak-tflops", default=None, help="peak FLOP/s per device (in TFLOP/s) for MFU on any device"
    )
    parser.add_argument(
        "--scaling-n",
        default=DEFAULT_N,
        help=f"a ladder's N for the fits: one of {', '.join(N_KINDS)} (docs/scaling.md)",
    )
    parser.add_argument(
        "--scaling-targets",
        default=",".join(DEFAULT_TARGETS),
        help="a ladder's extrapolation targets: model profiles (conf/model), comma-separated",
    )
    parser.add_argument(
        "--scaling-samples",
        type=int,
        default=Options.samples,
        help=f"bootstrap replicates of a ladder's intervals (default {Options.samples}, >= {MIN_SAMPLES})",
    )
    parser.add_argument(
        "--margin",
        default=DEFAULT_MARGIN,
        help=f"the equivalence margin δ of the held-out loss, nats/token (default {DEFAULT_MARGIN})",
    )
    parser.add_argument(
        "--accuracy-margin",
        default=DEFAULT_ACCURACY_MARGIN,
        help=f"the equivalence margin of downstream accuracies (default {DEFAULT_ACCURACY_MARGIN})",
    )
    parser.add_argument(
        "--target-loss",
        default=None,
        help="the held-out loss each arm's time to target is measured to (default: the control's final)",
    )
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    parser.add_argument("--quiet", action="store_true", help="do not print the Markdown")
    args = parser.parse_args(argv)
    peak = parse_peak(args.peak_tflops)  # as typed, so that the error line shows it
    scaling = parse_scaling(args.scaling_n, args.scaling_targets, args.scaling_samples)
    verdicts = VerdictOptions(
        margin=parse_positive("--margin", args.margin),
        accuracy_margin=parse_positive("--accuracy-margin", args.accuracy_margin),
        target_loss=parse_positive("--target-loss", args.target_loss),
    )
    rep = build_report(
        args.paths,
        args.out,
        args.control,
        peak,
        not args.no_plots,
        require_control=args.control is not None,
        scaling=scaling,
        verdicts=verdicts,
    )
    if not args.quiet:
        print(rep.markdown, end="")
    print(f"trmoe: report written to {rep.folder / REPORT_MD}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
