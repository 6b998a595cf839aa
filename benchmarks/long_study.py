"""The long CIFAR-10 study: every run of ``benchmarks.parity``'s task ``cifar10_full``, in the order that answers the
most first, resumable across sittings.

    nice -n 19 .venv/bin/python -m benchmarks.long_study            # run (or resume) what is left, then report
    .venv/bin/python -m benchmarks.long_study --list                # each run and whether its record is finished
    .venv/bin/python -m benchmarks.long_study --report-only         # rebuild the records' reports, train nothing

Each run writes its own record under ``benchmarks/results/parity_runs/<study>/``; a finished record of the same
command is skipped (``parity --reuse``), and a run stopped part-way resumes from its last epoch end's checkpoint
(``parity``'s resumable tasks: the record of a resumed run is that of an uninterrupted one). A study's report
(``benchmarks/results/<study>.json``) pools only finished runs: one still running or stopped is listed as pending.

The studies (:data:`STUDIES`): 2 workers (DDP and the recommended DGC, 3 seeds; DEFT, PowerSGD, DGC at the paper's
density 0.001 and DDP in fp32, one seed), 8 workers (DDP and DGC), and the same recipe at about 1k, 2k and 4k
optimizer steps (3, 5 and 10 epochs, the learning-rate drops at the same fractions), DDP and DGC, one seed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from benchmarks import common, parity

TASK = "cifar10_full"
RECOMMENDED = "dgc_1pct_int8"


@dataclass(frozen=True)
class Study:
    """One record of runs: ``name`` (``results/<name>.json``), its workers and epochs, and its runs as
    ``(seed, algorithm)`` in the order they are trained."""

    name: str
    devices: int
    epochs: int
    runs: tuple[tuple[int, str], ...]

    @property
    def seeds(self) -> list[int]:
        return sorted({seed for seed, _ in self.runs})

    @property
    def algos(self) -> list[str]:
        return list(dict.fromkeys(algo for _, algo in self.runs))

    def arguments(self, seeds: list[int], algos: list[str]) -> list[str]:
        """``benchmarks.parity``'s arguments for ``seeds`` x ``algos`` of this study."""
        return [
            "--tasks", TASK, "--full", "--epochs", str(self.epochs), "--devices", str(self.devices),
            "--name", self.name, "--seeds", ",".join(map(str, seeds)), "--algos", ",".join(algos), "--reuse",
        ]  # fmt: skip


PAIR = ("ddp", RECOMMENDED)
STUDIES = (
    Study("parity_full_cifar2", 2, 20, (
        *((s, a) for s in (42, 43, 44) for a in PAIR),
        (42, "dgc"), (42, "deft"), (42, "powersgd"), (42, "ddp_fp32"),
    )),
    Study("parity_full_cifar8", 8, 20, tuple((42, a) for a in PAIR)),
    *(Study(f"parity_full_length_e{e}", 2, e, tuple((42, a) for a in PAIR)) for e in (3, 5, 10)),
)  # fmt: skip
#: the order of the runs across studies: the headline pair first, then the seeds, the length figure, 8 workers, peers
ORDER: tuple[tuple[str, int, str], ...] = (
    *(("parity_full_cifar2", s, a) for s in (42, 43, 44) for a in PAIR),
    *((f"parity_full_length_e{e}", 42, a) for e in (3, 5, 10) for a in PAIR),
    *(("parity_full_cifar8", 42, a) for a in PAIR),
    *(("parity_full_cifar2", 42, a) for a in ("dgc", "deft", "powersgd", "ddp_fp32")),
)  # fmt: skip


def study(name: str) -> Study:
    return next(s for s in STUDIES if s.name == name)


def finished(name: str, seed: int, algo: str) -> bool:
    """Whether the run's record says it finished (the command's key is checked by ``parity --reuse``)."""
    record = parity.RUNS_DIR / name / f"{TASK}_{algo}_s{seed}.json"
    return record.is_file() and bool(json.loads(record.read_text()).get("finished"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.long_study", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-root", default=str(common.REPO.parent / "shared" / "data"))
    parser.add_argument("--list", action="store_true", help="list the runs and which are finished")
    parser.add_argument("--report-only", action="store_true", help="rebuild every study's report, train nothing")
    args = parser.parse_args(argv)
    con = common.console()
    if args.list:
        for name, seed, algo in ORDER:
            con.print(f"{'done   ' if finished(name, seed, algo) else 'pending'} {name} s{seed} {algo}")
        return 0
    code = 0
    if not args.report_only:
        for name, seed, algo in ORDER:  # parity skips a finished run of the same command, resumes a stopped one
            s = study(name)
            code |= parity.main([*s.arguments([seed], [algo]), "--data-root", args.data_root])
            report(s, args.data_root)  # the study's report again: the run's own call wrote it for that run alone
    for s in STUDIES:
        report(s, args.data_root)
    return code


def report(s: Study, data_root: str) -> None:
    """``results/<study>.json`` from every finished record of the study (a run not finished is listed as pending)."""
    parity.main([*s.arguments(s.seeds, s.algos), "--data-root", data_root, "--report-only"])


if __name__ == "__main__":
    sys.exit(main())
