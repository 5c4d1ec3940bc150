"""``python -m hybridpar.report``: runs' records (written here by hand, no training) into one
PNG and a markdown table, without importing JAX; bad workdirs are one ``error:`` line."""

import dataclasses
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from hybridpar.runtime.run_records import read_records
from hybridpar.tools import report

ROOT = Path(__file__).resolve().parents[1]


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def ev(event, step, epoch, wall_s, **values):
    return {"event": event, "step": step, "epoch": epoch, "wall_s": wall_s, **values}


def train(step, epoch, wall_s, stage, size, batch):
    return ev("train", step, epoch, wall_s, loss=1.0, lr=0.1 * epoch, momentum=0.9,
              images_per_s=1000.0, image_size=size, global_batch=batch, stage=stage)  # fmt: skip


def stage(index, step, epoch, wall_s, size, batch):
    return ev("stage", step, epoch, wall_s, stage=index, image_size=size, global_batch=batch)


def evaluation(step, epoch, wall_s, top1, top5, **more):
    return ev("eval", step, epoch, wall_s, top1=top1, top5=top5, loss=1.0, **more)


def curriculum_run(w: Path) -> None:
    """Two stages, four evals (the best is not the last), a completed summary."""
    write_jsonl(w / "metrics.jsonl", [
        ev("compile", 0, 0.0, 3.0, program="train", batch=32, image_size=16, compile_s=1.0),
        ev("compile", 0, 0.0, 4.0, program="train", batch=64, image_size=24, compile_s=2.0),
        stage(0, 0, 0.0, 5.0, 16, 32),
        *[train(s, s / 5, 5.0 + s, 0, 16, 32) for s in range(1, 11)],
        evaluation(5, 1.0, 10.5, 0.5, 0.8),
        evaluation(10, 2.0, 15.5, 0.7, 0.9),
        stage(1, 10, 2.0, 16.0, 24, 64),
        *[train(s, 2 + (s - 10) / 5, 6.0 + s, 1, 24, 64) for s in range(11, 21)],
        evaluation(15, 3.0, 22.0, 0.8, 0.95),
        evaluation(20, 4.0, 27.0, 0.75, 0.96),
        ev("checkpoint", 20, 4.0, 28.0, blocking_s=0.1, total_s=0.2, bytes=1000),
    ])  # fmt: skip
    (w / "summary.json").write_text(json.dumps({
        "steps": 20, "completed": True, "error": None, "wall_s": 30.0, "compile_s": 3.0,
        "train_images_per_s": 1234.5, "target_top1": 0.75, "target_top5": 0.99,
        "time_to_target": {"top1": {"target": 0.75, "value": 0.8, "step": 15, "epoch": 3.0,
                                    "wall_s": 22.0, "wall_s_without_compile": 19.0}},
    }))  # fmt: skip


def resumed_run(w: Path) -> None:
    """Killed after step 12 and resumed from the checkpoint at step 8: the steps after it
    ran again, and their second records count. The evaluator's eval is the best; no
    summary.json yet (still running)."""
    write_jsonl(w / "metrics.jsonl", [
        ev("compile", 0, 0.0, 3.0, program="train", batch=32, image_size=16, compile_s=1.5),
        stage(0, 0, 0.0, 4.0, 16, 32),
        *[train(s, s / 5, 4.0 + s, 0, 16, 32) for s in range(1, 13)],
        evaluation(5, 1.0, 9.5, 0.4, 0.7),
        evaluation(10, 2.0, 14.5, 0.95, 0.99),  # lost with the kill: superseded below
        ev("resume", 8, 1.6, 13.0, from_step=8),
        ev("compile", 8, 1.6, 14.0, program="train", batch=32, image_size=16, compile_s=1.5),
        stage(0, 8, 0.0, 14.5, 16, 32),  # the same stage, marked again on resume
        *[train(s, s / 5, 7.0 + s, 0, 16, 32) for s in range(9, 13)],
        evaluation(10, 2.0, 17.5, 0.6, 0.85),
    ])  # fmt: skip
    write_jsonl(w / "evaluator" / "metrics.jsonl", [
        evaluation(12, 2.4, 19.0, 0.65, 0.9, source="evaluator", examples=100, split="test"),
        ev("eval_skipped", 6, 1.2, None, source="evaluator", reason="deleted"),
    ])  # fmt: skip


def tables(text: str) -> list[list[dict]]:
    """Each markdown table in ``text``, as its rows (dicts by the header's cells)."""
    out, lines = [], text.splitlines() + [""]
    block: list[str] = []
    for x in lines:
        if x.startswith("|"):
            block.append(x)
            continue
        if block:
            header = [c.strip() for c in block[0].strip("|").split("|")]
            out.append([dict(zip(header, (c.strip() for c in y.strip("|").split("|"))))
                        for y in block[2:]])  # fmt: skip
            block = []
    return out


def table_rows(text: str) -> dict[str, dict]:
    """The runs' table (the first), by run."""
    return {r["run"]: r for r in tables(text)[0]}


def test_report_writes_a_png_and_a_table_of_the_runs_without_importing_jax(tmp_path):
    a, b, out = tmp_path / "curriculum", tmp_path / "resumed", tmp_path / "out" / "r.png"
    curriculum_run(a)
    resumed_run(b)
    config_run(tmp_path / "c", "2:16-4~0.95,4:24-8")  # its schedule from its config.json
    code = (
        "import runpy, sys; "
        f"sys.argv = ['report', {str(a)!r}, {str(b)!r}, {str(tmp_path / 'c')!r}, '--out', "
        f"{str(out)!r}]; "
        "runpy.run_module('hybridpar.report', run_name='__main__'); "
        "assert 'jax' not in sys.modules, 'jax imported'"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]

    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    with Image.open(out) as img:
        img.verify()
    with Image.open(out) as img:
        assert img.size[0] > 800 and img.size[1] > 400

    rows = table_rows(r.stdout)
    assert table_rows((tmp_path / "out" / "r.md").read_text()) == rows
    assert set(rows) == {"curriculum", "resumed", "c"}
    cur, res = rows["curriculum"], rows["resumed"]
    assert (cur["best top1"], cur["best top5"]) == ("0.8000", "0.9600")  # at other evals
    assert (cur["epochs"], cur["steps"], cur["status"]) == ("4", "20", "completed")
    assert cur["time to target"] == "top1 0.75: 22.0s (19.0s w/o compile); top5 0.99: not reached"
    assert (cur["wall s"], cur["compile s"], cur["images/s"]) == ("30.0", "3.0", "1234.5")
    # the pre-kill eval of step 10 (0.95) was superseded; the evaluator's 0.65 is the best
    assert (res["best top1"], res["best top5"]) == ("0.6500", "0.9000")
    assert res["steps"] == "12" and res["compile s"] == "3.0"  # both segments compiled
    assert res["status"].startswith("running") and res["time to target"] == "-"


def test_the_steps_a_resume_ran_again_count_once_as_their_second_run(tmp_path):
    resumed_run(tmp_path / "b")
    run = report.read_run(str(tmp_path / "b"))
    assert [t.step for t in run.train] == list(range(1, 13))
    assert [t.wall_s for t in run.train[8:]] == [16.0, 17.0, 18.0, 19.0]  # after the resume
    assert [(e.step, e.top1) for e in run.eval] == [(5, 0.4), (10, 0.6), (12, 0.65)]
    assert [s.wall_s for s in run.stage] == [4.0]  # the stage's first line, not its re-mark


def test_time_to_targets_of_our_own_from_the_eval_records(tmp_path):
    curriculum_run(tmp_path / "a")
    out = str(tmp_path / "r.png")
    rows = table_rows(report.report([str(tmp_path / "a")], out, {"top1": 0.7, "top5": 0.9}))
    # the eval of step 10 at 15.5 s, after 3 s of compiling
    want = "top1 0.7: 15.5s (12.5s w/o compile); top5 0.9: 15.5s (12.5s w/o compile)"
    assert rows["a"]["time to target"] == want
    rows = table_rows(report.report([str(tmp_path / "a")], out, {"top1": 0.99}))
    assert rows["a"]["time to target"] == "top1 0.99: not reached; top5 0.99: not reached"


def error_line(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        report.main(argv)
    assert e.value.code == 2
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1, errors
    return errors[0]


def test_bad_workdirs_are_one_error_line(tmp_path, capsys):
    out = str(tmp_path / "r.png")
    assert "no workdir" in error_line(capsys, [str(tmp_path / "nope"), "--out", out])
    (tmp_path / "empty").mkdir()
    assert "has no metrics.jsonl" in error_line(capsys, [str(tmp_path / "empty"), "--out", out])
    # a file: in the trainer's words, not "no workdir" (planted bug: read_run's check alone)
    (tmp_path / "afile").write_text("mine\n")
    line = error_line(capsys, [str(tmp_path / "afile"), "--out", out])
    assert f"workdir {str(tmp_path / 'afile')!r} is a file, not a folder; pass the" in line
    assert "is a fraction" in error_line(capsys, [str(tmp_path), "--target-top5", "80"])
    # none to reach (planted bug: "is a fraction: ... not 93" for these too)
    for low in ("0", "-0.5"):
        line = error_line(capsys, [str(tmp_path), "--target-top1", low])
        assert f"--target-top1={float(low):g} must be in (0, 1]: the top1 to time" in line, line
    assert not os.path.exists(out)
    # an --out matplotlib cannot write: refused before anything is read
    (tmp_path / "empty" / "metrics.jsonl").write_text("mine\n")
    mine = str(tmp_path / "empty" / "metrics.jsonl")
    assert "the figure is a PNG" in error_line(capsys, [str(tmp_path / "empty"), "--out", mine])
    assert (tmp_path / "empty" / "metrics.jsonl").read_text() == "mine\n"
    # one run twice (two identical rows), by the same path or another (planted bug: no check)
    a, again = str(tmp_path / "empty"), str(tmp_path / "empty" / ".." / "empty")
    assert f"{a} is given twice: name each" in error_line(capsys, [a, a, "--out", out])
    assert f"{again} is given twice (as {a})" in error_line(capsys, [a, again, "--out", out])
    assert not os.path.exists(out)


def test_an_out_that_cannot_be_written_is_one_error_line(tmp_path, capsys):
    """A run read where its report cannot be written (a read-only copy; here a folder that
    is a file): one error line naming the path and --out, not a traceback. Planted bug that
    fails it: the writes left unguarded."""
    curriculum_run(tmp_path / "a")
    (tmp_path / "file").write_text("mine\n")
    line = error_line(capsys, [str(tmp_path / "a"), "--out", str(tmp_path / "file" / "r.png")])
    assert "cannot write" in line and "--out" in line, line
    assert (tmp_path / "file").read_text() == "mine\n"


def test_a_file_report_did_not_write_is_replaced_only_with_overwrite(tmp_path, capsys):
    """``--out README.png`` beside the user's README.md (or over a PNG of theirs with no
    report .md beside it): one error line, nothing written; report's own earlier output
    (its .md starts with its line, or, written before that line, with the table's header)
    is replaced without a flag; ``--overwrite`` replaces the user's. Planted bugs that fail
    it: no check (the .md replaced); the check by the PNG alone."""
    curriculum_run(tmp_path / "a")
    a = str(tmp_path / "a")
    (tmp_path / "proj").mkdir()
    readme, png = tmp_path / "proj" / "README.md", tmp_path / "proj" / "README.png"
    readme.write_text("# My project\n")
    line = error_line(capsys, [a, "--out", str(png)])
    assert line.startswith(f"error: {readme} exists (written "), line
    # report's .md starts with its line, not the user's (planted: "its FILE.md starts with")
    assert (
        ") and report did not write it (report's own FILE.md starts with `<!-- written by "
        "python -m hybridpar.report`): pass --overwrite to replace "
    ) in line, line
    assert f"pass --overwrite to replace {readme}, or name another --out" in line, line
    assert readme.read_text() == "# My project\n" and not png.exists()
    (tmp_path / "fig.png").write_bytes(b"mine")  # a PNG with no report .md beside it
    fig = str(tmp_path / "fig.png")
    assert "pass --overwrite to replace" in error_line(capsys, [a, "--out", fig])
    assert (tmp_path / "fig.png").read_bytes() == b"mine" and not (tmp_path / "fig.md").exists()
    # report's own output, twice over, by default and with --out: no flag needed
    for argv in ([a], [a], [a, "--out", str(tmp_path / "r.png")]) * 2:
        report.main(argv)
        assert "replaced the files there" not in capsys.readouterr().out
    assert (tmp_path / "r.md").read_text().startswith(report.MARK + "\n")
    older = tmp_path / "old.md"  # written before the mark line: the table first
    older.write_text(report.markdown([]) + "| a | 1 |\n")
    report.main([a, "--out", str(tmp_path / "old.png")])
    assert older.read_text().startswith(report.MARK)
    report.main([a, "--out", str(png), "--overwrite"])
    assert "(replaced the files there, --overwrite)" in capsys.readouterr().out
    assert readme.read_text().startswith(report.MARK) and png.is_file()


def test_without_out_the_report_goes_in_the_first_workdir(tmp_path, monkeypatch, capsys):
    curriculum_run(tmp_path / "a")
    resumed_run(tmp_path / "b")
    monkeypatch.chdir(tmp_path)  # not into the current directory
    report.main([str(tmp_path / "a"), str(tmp_path / "b")])
    assert (tmp_path / "a" / "report.png").is_file() and (tmp_path / "a" / "report.md").is_file()
    assert not (tmp_path / "report.png").exists()
    assert f"wrote {tmp_path / 'a' / 'report.png'} and " in capsys.readouterr().out


def test_without_matplotlib_the_error_names_the_install(tmp_path, capsys, monkeypatch):
    curriculum_run(tmp_path / "a")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    line = error_line(capsys, [str(tmp_path / "a"), "--out", str(tmp_path / "r.png")])
    assert 'pip install -e ".[plot]"' in line


def test_a_record_cut_short_by_a_kill_does_not_swallow_the_next_one(tmp_path):
    """A writer killed mid-line leaves a partial last line; the resumed run's first record
    must still be its own line, which every reader keeps (the partial one is skipped)."""
    from hybridpar.runtime.metrics import MetricsWriter

    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(ev("train", 1, 0.1, 1.0)) + "\n" + '{"event": "train", "st')
    writer = MetricsWriter(str(tmp_path), start_time=0.0)
    writer.write("resume", 1, 0.1)
    writer.write("train", 2, 0.2, loss=0.5, lr=0.1)
    writer.close()
    records, _ = read_records(str(path))
    assert [r.event for r in records] == ["train", "resume", "train"]
    # and a file that ends cleanly gets no blank line
    MetricsWriter(str(tmp_path), start_time=0.0).close()
    assert path.read_text().endswith('"lr": 0.1}\n')


def tb_points(tb: Path) -> dict[str, list[tuple[int, float]]]:
    """The points TensorBoard shows of the event files in ``tb``, as its event reader
    (EventAccumulator) takes them: the files in name (start time) order, and a start's purge
    (a SessionLog START at step S) drops the points before it from step S on."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    points: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(tb.iterdir()):
        data, at = path.read_bytes(), 0
        while at + 12 <= len(data):  # a record: length, its CRC, the event, the event's CRC
            (n,) = struct.unpack("<Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + n])
            at += 16 + n
            if event.session_log.status == SessionLog.START:
                points = {t: [p for p in ps if p[0] < event.step] for t, ps in points.items()}
            for v in event.summary.value:
                points.setdefault(v.tag, []).append((event.step, v.simple_value))
    return points


def test_tensorboard_drops_the_points_of_the_steps_a_resume_trained_again(tmp_path):
    """Killed at step 132 and resumed from the checkpoint at 100: steps 101-132 ran again, so
    TensorBoard shows their second run only, as metrics.jsonl's readers do, and keeps what
    the first start wrote up to the checkpoint. Planted bug that fails it: no purge_step."""
    from hybridpar.runtime.metrics import MetricsWriter

    first = MetricsWriter(str(tmp_path), start_time=0.0)
    for step, loss in ((50, 2.0), (100, 1.5), (120, 1.25), (132, 1.0)):
        first.write("train", step, step / 10, loss=loss, lr=0.1)
    first.write("eval", 100, 10.0, top1=0.5, top5=0.875)
    first.write("eval", 132, 13.2, top1=0.625, top5=0.875)
    first.close()
    # its file named as its earlier start time would (both starts here are in one second)
    (old,) = (tmp_path / "tb").iterdir()
    old.rename(old.with_name("events.out.tfevents.0000000001.host"))
    resumed = MetricsWriter(str(tmp_path), start_time=0.0, purge_step=101)
    resumed.write("train", 110, 11.0, loss=1.125, lr=0.1)
    resumed.write("train", 132, 13.2, loss=0.75, lr=0.1)
    resumed.write("eval", 132, 13.2, top1=0.75, top5=1.0)
    resumed.close()
    points = tb_points(tmp_path / "tb")
    assert points["train/loss"] == [(50, 2.0), (100, 1.5), (110, 1.125), (132, 0.75)]
    assert points["eval/top1"] == [(100, 0.5), (132, 0.75)]


def test_tensorboard_has_each_line_once_written_not_at_close(tmp_path):
    """A start killed with -9 keeps every TensorBoard point it wrote, as metrics.jsonl does
    (and TensorBoard does not lag). Planted bug that fails it: tensorboardX's SummaryWriter
    (its thread flushes every 120 s; the file stays empty until close)."""
    from hybridpar.runtime.metrics import MetricsWriter

    writer = MetricsWriter(str(tmp_path), start_time=0.0)
    writer.write("train", 10, 1.0, loss=0.5, lr=0.25)
    assert tb_points(tmp_path / "tb") == {"train/loss": [(10, 0.5)], "train/lr": [(10, 0.25)]}
    writer.write("eval", 10, 1.0, top1=0.5, top5=0.75)
    assert tb_points(tmp_path / "tb")["eval/top1"] == [(10, 0.5)]
    writer.close()


def test_each_compiled_program_has_its_own_tensorboard_tag(tmp_path):
    """Every program compiles at the same step (the first stage's, or the resume's): the
    train and eval steps and each stage's batch and size are their own series, not points
    of one compile/compile_s. Planted bug that fails it: the tag by the event only."""
    from hybridpar.runtime.metrics import MetricsWriter

    writer = MetricsWriter(str(tmp_path), start_time=0.0)
    memory = {"total": 1000}
    writer.write("compile", 0, 0.0, program="train", batch=32, image_size=8, compile_s=2.5,
                 cache_hit=False, memory_per_device_bytes=memory)  # fmt: skip
    writer.write("compile", 0, 0.0, program="eval", batch=64, image_size=8, compile_s=1.5,
                 cache_hit=True, memory_per_device_bytes=memory)  # fmt: skip
    writer.write("compile", 0, 0.0, program="train", batch=64, image_size=16, compile_s=4.0,
                 cache_hit=False, memory_per_device_bytes=memory, background=True,
                 wait_s=0.5)  # fmt: skip
    writer.close()
    assert tb_points(tmp_path / "tb") == {
        "compile/train_batch32_size8/compile_s": [(0, 2.5)],
        "compile/eval_batch64_size8/compile_s": [(0, 1.5)],
        "compile/train_batch64_size16/compile_s": [(0, 4.0)],
        "compile/train_batch64_size16/wait_s": [(0, 0.5)],
    }


def cut(w: Path, how: str) -> None:
    """``w``'s metrics.jsonl damaged as a user's copy may be: emptied, cut short mid-line,
    or with a line that is not a record in the middle."""
    path = w / "metrics.jsonl"
    text = path.read_text()
    if how == "empty":
        path.write_text("")
    elif how == "cut short":
        path.write_text(text[: len(text) // 2])  # as head -c does: mid-line
    elif how.startswith("evaluator"):  # the evaluator's file, beside the trainer's
        e = evaluation(20, 4.0, 29.0, 0.9, 0.97, source="evaluator", examples=100, split="test")
        if how == "evaluator top1 gone":
            del e["top1"]
        write_jsonl(w / "evaluator" / "metrics.jsonl", [e])
        if how == "evaluator garbage":
            with open(w / "evaluator" / "metrics.jsonl", "a") as f:
                f.write("not a record {{\n")
    elif how == "garbage":
        lines = text.splitlines(keepends=True)
        path.write_text("".join(lines[:5]) + "not a record {{\n" + "".join(lines[5:]))
    else:  # a record without a field report computes with
        event, field, value = how.split()
        lines = [json.loads(x) for x in text.splitlines()]
        first = next(x for x in lines if x["event"] == event)
        if value == "gone":
            del first[field]
        else:
            first[field] = json.loads(value)
        write_jsonl(path, lines)


@pytest.mark.parametrize("how, lost", [
    ("empty", "it has no records of steps but the run at step 20 (summary.json)"),
    ("cut short", "its records end at step 10 but the run at step 20 (summary.json)"),
    ("garbage", "1 line of metrics.jsonl did not read"),
    ("eval top1 gone", "1 line of metrics.jsonl did not read"),
    ("train wall_s null", "1 line of metrics.jsonl did not read"),
    ("stage global_batch \"64\"", "1 line of metrics.jsonl did not read"),
    ("evaluator garbage", "1 line of evaluator/metrics.jsonl did not read"),
    ("evaluator top1 gone", "1 line of evaluator/metrics.jsonl did not read"),
])  # fmt: skip
def test_missing_records_are_a_warning_and_no_figure_is_made_of_them(tmp_path, capsys, how, lost):
    """An emptied or truncated metrics.jsonl of a completed run, or a line in it or in the
    evaluator's that does not read (not JSON, or a record without a field report computes
    with: an eval without top1, a train line's wall_s null, a batch that is not a number):
    one warning line naming the file and what is missing, and the figures the lost records
    would change are '-' (no stage table), not sums of what is left; the compile time is
    summary.json's.
    Planted bugs that fail it: no warning (read_run's counts left at 0); the bests, time to
    target or stages made of the records that read; read_run keeping a record that lacks a
    field (a TypeError)."""
    curriculum_run(tmp_path / "a")
    cut(tmp_path / "a", how)
    report.main([str(tmp_path / "a"), "--out", str(tmp_path / "r.png")])
    printed = capsys.readouterr()
    warnings = [x for x in printed.err.splitlines() if x.startswith("warning: ")]
    assert warnings == [f"warning: {tmp_path / 'a'}: {lost}: records are missing, so the "
                        "run's best top1/top5, time to target and stages are left out ('-') "
                        "and its compile s is summary.json's (if any)"]  # fmt: skip
    assert len(tables(printed.out)) == 1  # no stage table
    row = tables(printed.out)[0][0]
    cells = [row[k] for k in ("best top1", "best top5", "time to target", "compile s", "steps")]
    assert cells == ["-", "-", "-", "3.0", "20"]


def test_a_killed_starts_cut_line_before_its_resume_is_no_loss(tmp_path, capsys):
    """The line a kill cut short, ended by the next start's writer, is followed by that
    start's resume record: what it held ran again. No warning, every figure."""
    resumed_run(tmp_path / "b")
    path = tmp_path / "b" / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    at = next(i for i, x in enumerate(lines) if '"resume"' in x)
    path.write_text("".join(lines[:at]) + '{"event": "train", "st\n' + "".join(lines[at:]))
    assert report.read_run(str(tmp_path / "b")).unread == 0
    report.main([str(tmp_path / "b"), "--out", str(tmp_path / "r.png")])
    printed = capsys.readouterr()
    assert "warning" not in printed.err
    row = tables(printed.out)[0][0]
    assert (row["best top1"], row["compile s"]) == ("0.6500", "3.0")
    assert len(tables(printed.out)) == 2  # and its stages


def stopped_and_resumed_run(w: Path) -> None:
    """22 steps an epoch: stopped at step 74 (a save, and summary.json: stopped), resumed
    from there and killed after step 100 (no summary.json of its own): the first start's
    is still there, as the trainer leaves it."""

    def line(s, wall_s):
        return train(s, round(s / 22, 4), wall_s, 0, 16, 32)

    write_jsonl(w / "metrics.jsonl", [
        ev("compile", 0, 0.0, 3.0, program="train", batch=32, image_size=16, compile_s=2.0),
        stage(0, 0, 0.0, 4.0, 16, 32),
        *[line(s, 4.0 + s / 2) for s in (10, 20, 30, 40, 44, 50, 60, 70, 74)],
        evaluation(44, 2.0, 27.0, 0.5, 0.8),
        ev("checkpoint", 74, 3.3636, 41.5),
        ev("resume", 74, 3.3636, 45.0, from_step=74, from_wall_s=41.0),
        ev("compile", 74, 3.3636, 48.0, program="train", batch=32, image_size=16,
           compile_s=2.5),
        stage(0, 74, 3.3636, 48.5, 16, 32),
        *[line(s, 12.0 + s / 2) for s in (80, 88, 90, 100)],
        evaluation(88, 4.0, 56.5, 0.8, 0.97),
    ])  # fmt: skip
    (w / "summary.json").write_text(json.dumps({
        "steps": 74, "epochs": 3.3636, "completed": False, "error": None, "resumed_from": None,
        "wall_s": 42.0, "compile_s": 2.0, "train_images_per_s": 999.0,
        "time_breakdown": {"setup": 1.0, "compile": 2.0, "train": 39.0}, "goodput": 0.93,
    }))  # fmt: skip


def test_an_earlier_starts_summary_is_no_summary(tmp_path, capsys):
    """A resumed run killed (or still running) has the first start's summary.json: its 74
    steps, its wall, its end ("stopped") and its time bar are not the run's, so the row
    comes from the records (100 steps, the best eval at step 88, both starts' compiles),
    its status says the summary is an earlier start's, and no time bar is drawn; so too
    where the first start completed and the run was resumed with more epochs. Once the
    resumed start writes its own (resumed_from 74, the evaluator's rule), that one counts.
    Planted bug that fails it: the summary trusted whichever start wrote it."""
    import matplotlib

    matplotlib.use("Agg")
    w = tmp_path / "run"
    stopped_and_resumed_run(w)
    report.main([str(w), "--out", str(tmp_path / "r.png")])
    printed = capsys.readouterr()
    assert "warning" not in printed.err
    got = tables(printed.out)[0][0]
    keys = ("epochs", "steps", "best top1", "wall s", "compile s", "images/s", "status")
    assert tuple(got[k] for k in keys) == (
        "4.55", "100", "0.8000", "62.0", "4.5", "1000.0",
        "running or killed (summary.json is an earlier start's)",
    )  # fmt: skip
    run = report.read(str(w))
    titles = [a.get_title() for a in report.figure([("run", run)]).axes]
    assert "where the time went" not in titles
    # the first start completed (74 steps its last), resumed with more epochs: the same
    summary = json.loads((w / "summary.json").read_text())
    (w / "summary.json").write_text(json.dumps(summary | {"completed": True}))
    got = table_rows(report.report([str(w)], str(tmp_path / "r.png")))["run"]
    assert (got["steps"], got["status"]) == ("100", "running or killed (summary.json is an "
                                                    "earlier start's)")  # fmt: skip
    # the resumed start ended and wrote its own
    summary |= {"steps": 100, "epochs": 4.5455, "resumed_from": 74, "wall_s": 63.0}
    (w / "summary.json").write_text(json.dumps(summary))
    got = table_rows(report.report([str(w)], str(tmp_path / "r.png")))["run"]
    assert (got["steps"], got["wall s"], got["status"]) == ("100", "63.0", "stopped")
    titles = [a.get_title() for a in report.figure([("run", report.read(str(w)))]).axes]
    assert "where the time went" in titles


def test_no_compile_records_is_no_time_without_compile(tmp_path):
    """A run whose compile records are gone while summary.json counts compile time: the
    compile column is summary.json's and the time to target without it is '-', not the
    wall time less nothing. Planted bug that fails it: time_to subtracting the records'
    compile time (none) while the column shows summary.json's."""
    curriculum_run(tmp_path / "a")
    path = tmp_path / "a" / "metrics.jsonl"
    path.write_text("".join(x for x in path.read_text().splitlines(keepends=True)
                            if '"compile"' not in x))  # fmt: skip
    row = table_rows(report.report([str(tmp_path / "a")], str(tmp_path / "r.png")))["a"]
    assert row["compile s"] == "3.0"
    assert row["time to target"] == "top1 0.75: 22.0s (- w/o compile); top5 0.99: not reached"


def config_run(w: Path, stages: str, **optim) -> None:
    """A run with its config.json (8 data-parallel devices): a stage line per stage of
    ``stages``, train lines every epoch and an eval at the end of each stage."""
    from hybridpar.config.curriculum import stages_from_config
    from hybridpar.config.schema import base_config

    c = base_config()
    c.stages, c.num_epochs = stages, float(stages.split(",")[-1].split(":")[0])
    c.optim.update(base_lr=0.1, warmup_epochs=1.0, **optim)
    w.mkdir(parents=True)
    (w / "config.json").write_text(c.to_json())
    recs, start = [], 0.0
    for i, st in enumerate(stages_from_config(c, 8)):
        recs.append(ev("stage", int(start * 10), start, 5.0 + start, stage=i, data_parallel=8,
                       image_size=st.image_size, global_batch=st.global_batch))  # fmt: skip
        recs += [train(int(e * 10), e, 5.0 + e, i, st.image_size, st.global_batch)
                 for e in range(int(start) + 1, int(st.end_epoch) + 1)]  # fmt: skip
        recs.append(evaluation(int(st.end_epoch * 10), st.end_epoch, 5.5 + st.end_epoch, 0.5, 0.9))
        start = st.end_epoch
    write_jsonl(w / "metrics.jsonl", recs)


def test_the_schedule_comes_from_the_config_from_epoch_0_with_each_stage_a_step(tmp_path):
    """Warmup from epoch 0 though the first train line is at epoch 1; at a stage switch the
    learning rate (linear in the batch) and the stage's momentum change at one epoch."""
    config_run(tmp_path / "a", "2:16-4~0.95,4:24-8")  # batches 32 then 64
    s = report.schedule(report.read_run(str(tmp_path / "a")))
    epochs, lr = s["learning rate"]
    peak = 0.1 * 32 / 256  # base_lr x batch / lr_batch_base, at the end of the warmup
    assert epochs[0] == 0.0 and lr[0] == 0.0 and max(lr[epochs < 2]) == pytest.approx(peak)
    at = list(epochs).index(2.0)  # the switch: both values at one epoch, no slope between
    assert epochs[at + 1] == 2.0 and lr[at + 1] == pytest.approx(2 * lr[at])
    m_epochs, momentum = s["momentum"]
    assert list(momentum[m_epochs < 2]) == [0.95] * sum(m_epochs < 2)
    assert set(momentum[m_epochs > 2]) == {0.9} and momentum[at + 1] == 0.9
    assert s["global batch"][1][0] == 32 and s["global batch"][1][-1] == 64
    assert epochs[-1] == 4.0


def test_series_that_no_run_changes_are_a_note_not_a_panel(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    config_run(tmp_path / "fixed", "4:16-8")
    config_run(tmp_path / "stages", "2:16-4~0.95,4:24-8")
    fixed, stages = (report.read_run(str(tmp_path / n)) for n in ("fixed", "stages"))
    assert report.drawn([report.schedule(fixed)]) == ["learning rate"]
    both = [report.schedule(fixed), report.schedule(stages)]
    assert report.drawn(both) == ["learning rate", "momentum", "global batch", "image size (px)"]
    fig = report.figure([("fixed", fixed)])
    assert len(fig.axes) == 3  # accuracy twice, the learning rate
    note = "fixed throughout (not drawn): momentum 0.9, global batch 64, image size (px) 16"
    assert note in fig._suptitle.get_text()


def test_evaluator_points_are_hollow_a_long_run_puts_wall_time_on_a_log_axis(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    curriculum_run(tmp_path / "a")  # wall 5..28 s, the trainer's evals
    resumed_run(tmp_path / "b")  # one eval of the evaluator's, at 19 s
    runs = [(n, report.read_run(str(tmp_path / n))) for n in ("a", "b")]
    wall = report.figure(runs).axes[0]
    hollow = [line.get_xdata() for line in wall.lines if line.get_markerfacecolor() == "white"]
    assert [list(x) for x in hollow if len(x)] == [[19.0], [19.0]]  # its top-1 and top-5
    filled = [x for line in wall.lines if line.get_marker() != "None"
              and line.get_markerfacecolor() != "white" for x in line.get_xdata()]  # fmt: skip
    assert 19.0 not in filled and 22.0 in filled
    assert wall.get_xscale() == "linear" and wall.get_xlim()[0] == 0
    long = report.read_run(str(tmp_path / "a"))
    long.eval = [dataclasses.replace(e, wall_s=e.wall_s * 10) for e in long.eval]
    long.train = [dataclasses.replace(t, wall_s=t.wall_s * 10) for t in long.train]
    assert report.figure([*runs, ("long", long)]).axes[0].get_xscale() == "log"


def test_the_time_breakdown_is_one_stacked_bar_per_run(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    curriculum_run(tmp_path / "a")
    run = report.read_run(str(tmp_path / "a"))
    parts = {"train": 20.0, "setup": 2.0, "compile": 3.0, "eval": 1.0, "input_wait": 2.0,
             "checkpoint": 0.5, "redone": 1.0, "other": 0.5}  # fmt: skip
    run.summary |= {"time_breakdown": parts, "goodput": 0.7}  # its own, not 20 / 30
    fig = report.figure([("a", run), ("no breakdown", report.read_run(str(tmp_path / "a")))])
    ax = next(a for a in fig.axes if a.get_title() == "where the time went")
    order = ["setup", "compile", "train", "input_wait", "eval", "checkpoint", "redone", "other"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == order
    bars = ax.patches
    assert [b.get_width() for b in bars] == [parts[p] for p in order]
    assert [b.get_x() for b in bars] == pytest.approx([0, 2, 5, 25, 27, 28, 28.5, 29.5])
    assert [t.get_text() for t in ax.texts] == [" goodput 70%"]


def test_time_to_target_is_one_rule_from_every_eval_with_or_without_the_flag(tmp_path):
    """summary.json times its target from the trainer's evals only; the evaluator reached
    it first. The table gives the evaluator's time whether the target is summary.json's,
    config.json's (no summary yet: it showed "-") or asked for."""
    w = tmp_path / "a"
    write_jsonl(w / "metrics.jsonl", [
        ev("compile", 0, 0.0, 3.0, program="train", batch=32, image_size=16, compile_s=2.0),
        evaluation(10, 1.0, 60.0, 0.7, 0.95),
        evaluation(30, 3.0, 144.5, 0.8, 0.99),
    ])  # fmt: skip
    write_jsonl(w / "evaluator" / "metrics.jsonl", [
        evaluation(20, 2.0, 117.8, 0.75, 0.99, source="evaluator", split="test"),
    ])  # fmt: skip
    (w / "summary.json").write_text(json.dumps({
        "completed": True, "target_top5": 0.99,
        "time_to_target": {"top5": {"target": 0.99, "value": 0.99, "step": 30, "epoch": 3.0,
                                    "wall_s": 144.5, "wall_s_without_compile": 142.5}},
    }))  # fmt: skip
    out = str(tmp_path / "r.png")
    want = "top5 0.99: 117.8s (115.8s w/o compile)"
    assert table_rows(report.report([str(w)], out))["a"]["time to target"] == want
    assert table_rows(report.report([str(w)], out, {"top5": 0.99}))["a"]["time to target"] == want
    # still training (or killed): no summary.json, the target from config.json
    (w / "summary.json").unlink()
    (w / "config.json").write_text(json.dumps({"target_top1": 0.0, "target_top5": 0.99}))
    assert table_rows(report.report([str(w)], out))["a"]["time to target"] == want


def test_plain_second_ticks_no_empty_panel_and_a_title_of_what_differs(tmp_path):
    """A log wall axis labelled 30, 40, 60, 100 (not 3x10^1); every panel drawn holds data
    and every row of the grid is filled (five panels: 3 + 2, no empty slot); a panel with
    no data for any run is not drawn; the title names the config key the runs differ in,
    and the settings they share once."""
    import matplotlib

    matplotlib.use("Agg")
    config_run(tmp_path / "a", "2:16-4,4:24-4")  # batch 32 throughout, size 16 then 24
    config_run(tmp_path / "b", "4:24-4")
    runs = [(n, report.read_run(str(tmp_path / n))) for n in ("a", "b")]
    runs[0][1].summary = {"time_breakdown": {"setup": 1.0, "train": 9.0}}
    fig = report.figure(runs)
    assert [a.get_ylabel() or a.get_title() for a in fig.axes] == [
        "accuracy", "accuracy", "where the time went", "learning rate", "image size (px)",
    ]  # fmt: skip
    for ax in fig.axes:
        assert any(len(line.get_xdata()) for line in ax.lines) or ax.patches, ax.get_ylabel()
    rows: dict[int, int] = {}
    for ax in fig.axes:
        spec = ax.get_subplotspec()
        rows[spec.rowspan.start] = rows.get(spec.rowspan.start, 0) + len(spec.colspan)
    assert len(set(rows.values())) == 1  # each row as wide as the grid
    title = fig._suptitle.get_text()
    assert "runs differ in: stages (a 2:16-4,4:24-4, b 4:24-4)" in title
    assert title.count("momentum 0.9") == 1 and title.count("global batch 32") == 1

    wall = fig.axes[0]
    wall.set_xscale("linear")
    report.wall_axis(wall, [25.0, 120.0])  # a short run and one over 4x its length
    wall.set_xlim(25, 120)
    fig.canvas.draw()
    major, minor = (
        [t.get_text() for t in labels if t.get_text() and 25 <= t.get_position()[0] <= 120]
        for labels in (wall.get_xticklabels(), wall.get_xticklabels(minor=True))
    )
    assert (wall.get_xscale(), major, minor) == ("log", ["100"], ["30", "40", "60"])

    for _, run in runs:  # no evals yet, no breakdown: no accuracy or time panels
        run.eval, run.summary = [], None
    assert [a.get_ylabel() for a in report.figure(runs).axes] == ["learning rate",
                                                                   "image size (px)"]  # fmt: skip


def test_background_compiles_count_only_the_wait_as_summary_json_does(tmp_path):
    """A later stage compiled in the background overlaps training: the trainer counts only
    how long its stage switch waited (``wait_s``), in compile time and in the time to a
    target without compilation; the report counts the same."""
    w = tmp_path / "a"
    bg = {"program": "train", "batch": 64, "background": True}
    write_jsonl(w / "metrics.jsonl", [
        ev("compile", 0, 0.0, 7.157, program="train", batch=32, image_size=16, compile_s=3.667),
        ev("compile", 0, 0.0, 7.158, program="eval", batch=128, image_size=32, compile_s=0.526),
        stage(0, 0, 0.0, 7.194, 16, 32),
        evaluation(44, 1.0, 12.535, 0.1, 0.5),
        ev("compile", 44, 1.0, 13.394, image_size=24, compile_s=6.204, wait_s=0.856, **bg),
        stage(1, 44, 1.0, 13.395, 24, 64),
        ev("compile", 66, 2.0, 19.038, image_size=32, compile_s=5.628, wait_s=1.78, **bg),
        stage(2, 66, 2.0, 19.039, 32, 64),
        evaluation(88, 3.0, 22.397, 0.56, 0.94),
    ])  # fmt: skip
    # the trainer's own numbers for these records
    (w / "summary.json").write_text(json.dumps({
        "completed": True, "steps": 88, "wall_s": 22.6, "compile_s": 6.829, "target_top1": 0.4,
        "time_to_target": {"top1": {"target": 0.4, "value": 0.56, "step": 88, "epoch": 3.0,
                                    "wall_s": 22.397, "wall_s_without_compile": 15.568}},
    }))  # fmt: skip
    run = report.read_run(str(w))
    assert report.time_to(run, "top1", 0.4) == pytest.approx(
        {"wall_s": 22.397, "wall_s_without_compile": 15.568})
    row = table_rows(report.report([str(w)], str(tmp_path / "r.png")))["a"]
    assert row["compile s"] == "6.8"
    assert row["time to target"] == "top1 0.4: 22.4s (15.6s w/o compile)"


def warmup_run(w: Path, every: int = 1) -> None:
    """Two stages of 8 and 4 steps an epoch (batch 8, then 16), a warmup and a momentum
    ramp across the switch; a train line every ``every`` steps (and at each stage's end)
    with the values the trainer logs: at step s, the schedules at step s - 1, which its
    last update used."""
    from hybridpar.config.curriculum import plan_stages, stages_from_config
    from hybridpar.config.schema import base_config
    from hybridpar.program.optim import make_momentum_schedule, make_schedule

    c = base_config()
    c.stages, c.num_epochs = "1:16-1,3:24-2", 3.0
    c.optim.update(base_lr=0.4, warmup_epochs=1.5, momentum_start=0.5, momentum_ramp_epochs=2.0)
    plan = plan_stages(stages_from_config(c, 8), lambda batch: 64 // batch, data_parallel=8)
    lr, momentum = make_schedule(c.optim, plan), make_momentum_schedule(c.optim, plan)
    w.mkdir(parents=True)
    (w / "config.json").write_text(c.to_json())
    recs = []
    for p in plan.stages:
        st = p.stage
        recs.append(ev("stage", p.start_step, p.start_epoch, 1.0, stage=p.index,
                       image_size=st.image_size, global_batch=st.global_batch, data_parallel=8))
        recs += [ev("train", s, round(plan.epoch_at(s), 4), 1.0 + s, loss=1.0,
                    lr=float(lr(s - 1)), momentum=float(momentum(s - 1)), stage=p.index,
                    image_size=st.image_size, global_batch=st.global_batch)
                 for s in range(p.start_step + 1, p.end_step + 1)
                 if s % every == 0 or s == p.end_step]  # fmt: skip
    write_jsonl(w / "metrics.jsonl", recs)


def off_curve(curve, dots) -> float:
    """The largest vertical distance of a dot from the curve (a polyline whose steps are
    two points at one x)."""
    (xs, ys), worst = curve, 0.0
    for x, y in zip(*dots):
        gaps = []
        for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]):
            if x0 == x1 == x:  # a step: anywhere between its two values
                gaps.append(max(min(y0, y1) - y, y - max(y0, y1), 0.0))
            elif x0 <= x <= x1 and x0 < x1:
                gaps.append(abs(y0 + (y1 - y0) * (x - x0) / (x1 - x0) - y))
        worst = max(worst, min(gaps))
    return worst


@pytest.mark.parametrize("every", [1, 3])
def test_logged_learning_rate_and_momentum_lie_on_the_schedule_curve(tmp_path, every):
    """A line at step s logs the values step s - 1 ran with: drawn where that step began,
    one step's epochs before the line's own epoch (a step's length from its stage, so with
    a batch that changes per stage and with lines that are not every step)."""
    import matplotlib

    matplotlib.use("Agg")
    warmup_run(tmp_path / "a", every)
    fig = report.figure([("a", report.read_run(str(tmp_path / "a")))])
    for name in ("learning rate", "momentum"):
        ax = next(a for a in fig.axes if a.get_ylabel() == name)
        curve = [(line.get_xdata(), line.get_ydata()) for line in ax.lines
                 if line.get_label() == "a"]  # fmt: skip
        dots = [(line.get_xdata(), line.get_ydata()) for line in ax.lines
                if line.get_linestyle() == "None"]  # fmt: skip
        assert len(dots) == 1 and len(dots[0][0]) >= 7, name
        # a step's change in warmup is over 1/12 of the peak: a dot a step off is far off
        assert off_curve(curve[0], dots[0]) <= 1e-3 * max(curve[0][1]), name


def test_a_long_title_is_wrapped_to_the_figure_width(tmp_path):
    """Many keys that differ, with long values and run names: the title's lines are broken
    (nothing lost) so that each fits the figure's width as drawn."""
    import matplotlib

    matplotlib.use("Agg")
    names = ("a-run-with-a-rather-long-name", "b-run-with-a-rather-long-name")
    for name in names:
        config_run(tmp_path / name, "2:16-4,4:24-4")
        c = json.loads((tmp_path / name / "config.json").read_text())
        c |= {key: f"{key}-{name[0] * 30}" for key in ("init_from", "mesh", "note", "label")}
        (tmp_path / name / "config.json").write_text(json.dumps(c))
    runs = [(n, report.read_run(str(tmp_path / n))) for n in names]
    schedules = [report.schedule(r) for _, r in runs]
    whole = report.title(runs, schedules, report.drawn(schedules), True)
    assert max(len(line) for line in whole.splitlines()) > 400  # far wider than the figure
    fig = report.figure(runs)
    fig.canvas.draw()
    box, page = fig._suptitle.get_window_extent(), fig.bbox
    assert page.x0 <= box.x0 and box.x1 <= page.x1, (box, page)  # its widest line fits
    text = fig._suptitle.get_text()
    assert text.replace("\n", " ") == whole.replace("\n", " ")  # only broken, nothing lost
    assert len(text.splitlines()) > len(whole.splitlines())


def test_a_run_stopped_between_train_lines_shows_the_summarys_epoch(tmp_path):
    # Its last train line was at step 20 (epoch 0.91); it stopped at step 23 (epoch 1.05).
    w = tmp_path / "stopped"
    write_jsonl(w / "metrics.jsonl", [train(s, s / 22, 1.0 + s, 0, 16, 32) for s in (10, 20)])
    summary = {"steps": 23, "epochs": 1.0455, "completed": False, "error": "disk full"}
    (w / "summary.json").write_text(json.dumps(summary))
    got = report.row("stopped", report.read_run(str(w)), {})
    assert (got["steps"], round(got["epochs"], 2), got["status"]) == (23, 1.05, "error")


def test_a_batch_that_differs_between_runs_is_named_once_in_the_title(tmp_path):
    """Two runs without stages at global batch 64 and 32: the config key ``global_batch``
    and the schedule's global batch are the same figure, listed once (the schedule's).
    Planted bug that fails it: the config keys listed whatever the schedule lists."""
    import matplotlib

    matplotlib.use("Agg")
    for name, per_device in (("digits", 8), ("digits_b", 4)):
        config_run(tmp_path / name, f"4:24-{per_device}")
        c = json.loads((tmp_path / name / "config.json").read_text())
        c["stages"], c["global_batch"], c["data"]["image_size"] = "", per_device * 8, 24
        (tmp_path / name / "config.json").write_text(json.dumps(c))
    runs = [(n, report.read_run(str(tmp_path / n))) for n in ("digits", "digits_b")]
    title = report.figure(runs)._suptitle.get_text().replace("\n", " ")
    assert "global batch (digits 64, digits_b 32)" in title
    assert "global_batch" not in title and title.count("64") == 1, title


def test_each_stage_has_its_steps_time_and_images_per_second(tmp_path, capsys):
    """A table per stage (printed and in the .md) beside the run's one images/s: each train
    line's steps (since the line before it) x batch / images/s, summed per stage, images
    over those seconds; after a resume, the steps' second run. Stage 0: 4 steps at batch
    32 in 0.2 + 0.1 s; stage 1: 4 steps at batch 64 in 1 + 0.5 + 1 s (killed after step 8,
    resumed from step 5). Planted bugs that fail it: one step per line, the mean of the
    lines' images/s, the lines a resume superseded kept, one row for the run."""

    def line(step, stage, size, batch, ips):
        return ev("train", step, step / 4, 10.0 + step, loss=1.0, lr=0.1, images_per_s=ips,
                  image_size=size, global_batch=batch, stage=stage)  # fmt: skip

    w = tmp_path / "run"
    write_jsonl(w / "metrics.jsonl", [
        stage(0, 0, 0.0, 5.0, 16, 32),
        line(2, 0, 16, 32, 320.0),  # 2 steps: 0.2 s
        line(4, 0, 16, 32, 640.0),  # 2 steps: 0.1 s
        stage(1, 4, 1.0, 15.0, 24, 64),
        line(5, 1, 24, 64, 64.0),  # 1 step: 1 s
        line(8, 1, 24, 64, 8.0),  # killed after it: superseded
        ev("resume", 5, 1.25, 20.0, from_step=5),
        stage(1, 5, 1.25, 21.0, 24, 64),
        line(7, 1, 24, 64, 256.0),  # 2 steps: 0.5 s
        line(8, 1, 24, 64, 64.0),  # 1 step: 1 s
    ])  # fmt: skip
    report.main([str(w), "--out", str(tmp_path / "r.png")])
    printed = capsys.readouterr().out
    assert tables((tmp_path / "r.md").read_text()) == tables(printed)
    runs, stages = tables(printed)
    assert [(r["run"], r["steps"]) for r in runs] == [("run", "8")]
    keys = ("stage", "image size", "global batch", "steps", "train s", "images/s")
    assert [tuple(r[k] for k in keys) for r in stages] == [("0", "16", "32", "4", "0.3", "426.7"),
                                                           ("1", "24", "64", "4", "2.5", "102.4")]
    assert "per stage (train steps only" in printed


@pytest.mark.parametrize("name, text, why", [
    ("summary.json", '{"steps": 2', "(Expecting"),
    ("config.json", '{"steps": 2', "(Expecting"),
    ("summary.json", "[1, 2]", "(it holds [1, 2], not a JSON object)"),
    ("config.json", '"hello"', '(it holds "hello", not a JSON object)'),
])  # fmt: skip
def test_a_json_record_that_does_not_read_is_one_error_line_that_fits_a_reader(
    tmp_path, capsys, name, text, why
):
    """A summary.json or config.json cut short, or that holds no JSON object: one error:
    line, exit code 2, that says what report (which only reads) can do, not the trainer's
    "move it away to start over"; moved aside as it says, the run is reported from what is
    left: with no summary.json, the status says so and config.json's -1 (no target) is no
    target. Planted bugs that fail it: report reading with the trainer's wording (read_run's
    default); the status from config.json as if it were the summary ("stopped"); a target
    of -1 timed; read_json returning what is not an object (an AttributeError)."""
    curriculum_run(tmp_path / "a")
    (tmp_path / "a" / "config.json").write_text(json.dumps({"target_top1": 0.75,
                                                            "target_top5": -1.0}))  # fmt: skip
    (tmp_path / "a" / name).write_text(text)
    out = str(tmp_path / "r.png")
    line = error_line(capsys, [str(tmp_path / "a"), "--out", out])
    assert line.startswith(f"error: cannot read {str(tmp_path / 'a' / name)!r} {why}"), line
    assert "start over" not in line and "report only reads a run" in line, line
    assert f"move it aside (e.g. to {name}.bad)" in line, line
    (tmp_path / "a" / name).rename(tmp_path / "a" / f"{name}.bad")
    report.main([str(tmp_path / "a"), "--out", out])
    row = table_rows(capsys.readouterr().out)["a"]
    assert row["best top1"] == "0.8000"
    if name == "summary.json":  # config.json's targets, and nothing of the run's end
        assert row["status"] == "running or killed (no summary.json)"
        assert row["time to target"] == "top1 0.75: 22.0s (19.0s w/o compile)"
    else:
        assert row["status"] == "completed"
        assert row["time to target"].endswith("; top5 0.99: not reached")


def resumed_longer_run(w: Path, changed: list[str]) -> None:
    """Trained 3 epochs of 10 steps with num_epochs=3, then resumed at step 30 with
    num_epochs=4 and ``changed`` as the resume's changed keys: config.json holds the new
    config, the first start's train lines the old schedule's values (logged as the trainer
    logs them: at step s, the learning rate step s - 1 ran with)."""
    from hybridpar.config.curriculum import plan_stages, stages_from_config
    from hybridpar.config.schema import base_config
    from hybridpar.program.optim import make_schedule

    def lr_of(num_epochs):
        c = base_config()
        c.global_batch, c.num_epochs = 64, num_epochs
        c.optim.update(base_lr=0.4, warmup_epochs=1.0)
        plan = plan_stages(stages_from_config(c, 8), lambda batch: 640 // batch, data_parallel=8)
        return c, make_schedule(c.optim, plan)

    (_, old), (new_config, new) = lr_of(3.0), lr_of(4.0)
    w.mkdir(parents=True)
    (w / "config.json").write_text(new_config.to_json())

    def line(s, lr):
        return ev("train", s, s / 10, 1.0 + s, loss=1.0, lr=float(lr(s - 1)), momentum=0.9,
                  image_size=16, global_batch=64, stage=0)  # fmt: skip

    write_jsonl(w / "metrics.jsonl", [
        ev("stage", 0, 0.0, 1.0, stage=0, image_size=16, global_batch=64, data_parallel=8),
        *[line(s, old) for s in range(1, 31)],
        ev("resume", 30, 3.0, 40.0, from_step=30, from_wall_s=31.0, changed_keys=changed),
        ev("stage", 30, 3.0, 41.0, stage=0, image_size=16, global_batch=64, data_parallel=8),
        *[line(s, new) for s in range(31, 41)],
    ])  # fmt: skip


def test_a_resume_that_changed_the_schedule_draws_the_config_curve_from_there_on(tmp_path):
    """Resumed with num_epochs 3 -> 4, config.json's schedule is the second start's only:
    the curve starts at the resume (a vertical line there names the changed key), the
    second start's dots lie on it, and the first start's are dots alone (the 3-epoch decay
    put them far under the 4-epoch curve). A resume that changed no schedule key keeps the
    curve from epoch 0. Planted bug that fails it: read() without the resume's change (the
    curve from epoch 0 out of the new config)."""
    import matplotlib

    matplotlib.use("Agg")
    resumed_longer_run(tmp_path / "a", ["num_epochs", "optim.weight_decay"])
    run = report.read(str(tmp_path / "a"))
    ax = next(a for a in report.figure([("a", run)]).axes if a.get_ylabel() == "learning rate")
    (curve,) = [(line.get_xdata(), line.get_ydata()) for line in ax.lines
                if line.get_label() == "a"]  # fmt: skip
    (dots,) = [(line.get_xdata(), line.get_ydata()) for line in ax.lines
               if line.get_linestyle() == "None"]  # fmt: skip
    assert min(curve[0]) == pytest.approx(3.0) and max(curve[0]) == pytest.approx(4.0)
    after = [(x, y) for x, y in zip(*dots) if x >= 3.0]
    assert len(after) == 10 and off_curve(curve, list(zip(*after))) <= 1e-3 * max(curve[1])
    (marks,) = [line for line in ax.lines if "resumed with" in str(line.get_label())]
    assert list(marks.get_xdata()) == [3.0, 3.0]
    assert "num_epochs, optim.weight_decay changed" in marks.get_label()
    # the global batch from the stage lines before the resume, the config's after
    batch = report.schedule(run)["global batch"]
    assert batch[0][0] == 0.0 and batch[0][-1] == pytest.approx(4.0) and set(batch[1]) == {64}

    resumed_longer_run(tmp_path / "b", ["eval_every_epochs"])  # not a schedule key
    fig = report.figure([("b", report.read(str(tmp_path / "b")))])
    ax = next(a for a in fig.axes if a.get_ylabel() == "learning rate")
    (curve,) = [line.get_xdata() for line in ax.lines if line.get_label() == "b"]
    assert min(curve) == 0.0
    assert not [line for line in ax.lines if "resumed with" in str(line.get_label())]


def test_the_keys_that_differ_are_named_under_the_table_an_empty_value_as_quotes(tmp_path, capsys):
    """The printed and .md tables name the config keys the runs differ in, as the PNG's
    title does (its code); an empty value is '' there, not blank. Planted bugs that fail
    it: no line under the table; an empty value printed as nothing."""
    import matplotlib

    matplotlib.use("Agg")
    for name, note in (("digits", ""), ("cur", "warm")):
        config_run(tmp_path / name, "4:24-4")
        c = json.loads((tmp_path / name / "config.json").read_text())
        (tmp_path / name / "config.json").write_text(json.dumps(c | {"note": note}))
    report.main([str(tmp_path / "digits"), str(tmp_path / "cur"), "--out",
                 str(tmp_path / "r.png")])  # fmt: skip
    printed = capsys.readouterr().out
    want = "\nruns differ in: note (digits '', cur warm)\n"
    assert want in printed and want in (tmp_path / "r.md").read_text()
    assert len(tables(printed)[0]) == 2  # the line ends the table
    runs = [(n, report.read_run(str(tmp_path / n))) for n in ("digits", "cur")]
    assert "note (digits '', cur warm)" in report.figure(runs)._suptitle.get_text()


def test_the_key_to_hollow_markers_only_where_there_are_evaluator_evals(tmp_path):
    """Without the evaluator's evals no marker is hollow: the title and the legend do not
    speak of them. Planted bug that fails it: the key drawn for every figure."""
    import matplotlib

    matplotlib.use("Agg")
    curriculum_run(tmp_path / "a")  # the trainer's evals only
    resumed_run(tmp_path / "b")  # one of the evaluator's
    for names, hollow in ((["a"], False), (["a", "b"], True)):
        fig = report.figure([(n, report.read_run(str(tmp_path / n))) for n in names])
        legend = [t.get_text() for a in fig.axes if a.get_legend()
                  for t in a.get_legend().get_texts()]  # fmt: skip
        assert ("hollow the evaluator's" in fig._suptitle.get_text()) == hollow, names
        assert ("evaluator's eval" in legend) == hollow, legend


def test_help_names_every_panel(capsys):
    """--help says what the PNG holds: accuracy, where the time went and the schedule, and
    the tables. Planted bug that fails it: the old "one plot of accuracy ... and a table"."""
    with pytest.raises(SystemExit):
        report.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "where the time went, the schedule against epochs) and tables of the runs" in text


def test_a_record_the_evaluator_was_killed_writing_is_no_loss(tmp_path, capsys):
    """An evaluator killed mid-line leaves a line its next start's writer ends: a record cut
    short, which that start evaluates again. Counted lost, it blanked the run's best top1
    and time to target. Not a loss; other garbage still is (the missing-records test).
    Planted bug that fails it: a torn line counted as unread."""
    curriculum_run(tmp_path / "a")
    e = evaluation(17, 3.4, 25.0, 0.9, 0.97, source="evaluator", examples=100, split="test")
    write_jsonl(tmp_path / "a" / "evaluator" / "metrics.jsonl", [e])
    path = tmp_path / "a" / "evaluator" / "metrics.jsonl"
    path.write_text('{"event": "eval", "step": 15, "ep\n' + path.read_text())
    assert report.read_run(str(tmp_path / "a")).unread_evaluator == 0
    report.main([str(tmp_path / "a"), "--out", str(tmp_path / "r.png")])
    printed = capsys.readouterr()
    assert "warning" not in printed.err, printed.err
    assert tables(printed.out)[0][0]["best top1"] == "0.9000"
