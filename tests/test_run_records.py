"""``hybridpar.runtime.run_records``: every metrics.jsonl event round-trips through its one line
format and reader; a line cut short by a kill is skipped and the rest read; lines of other
versions (fields or events this one does not declare) read and keep what they carry; the
atomic JSON write leaves the old file whole when it fails. No JAX."""

import json

import pytest

from hybridpar.runtime import run_records as rr

COMMON = {"step": 33, "epoch": 1.5, "wall_s": 12.5}
MEMORY = {"arguments": 10, "outputs": 2, "temp": 30, "aliased": 1, "total": 41}
# one record per event, every declared field set (as the trainer and evaluator write them)
SAMPLES = {
    "data": dict(source="digits", train_split="train", eval_split="test", train_examples=1437,
                 eval_examples=360, num_classes=10, skipped=1, converted=2, rotated=0,
                 splits={"train": {"examples": 1437, "skipped": 1}}),
    "compile": dict(program="train", batch=64, image_size=32, compile_s=7.5, cache_hit=False,
                    loaded_from="/x/exec", memory_per_device_bytes=MEMORY, background=True,
                    wait_s=0.25),
    "stage": dict(stage=1, image_size=24, global_batch=128, min_scale=0.08, steps=55,
                  data_parallel=8, mesh="data:4,fsdp:2"),
    "train": dict(loss=0.5, lr=0.1, momentum=0.9, images_per_s=400.5, image_size=32,
                  global_batch=64, stage=0, skipped_steps=0, loss_scale=1.0),
    "eval": dict(split="test", loss=0.6, top1=0.98, top5=1.0, examples=360, source="evaluator"),
    "eval_skipped": dict(source="evaluator", reason="deleted before it was evaluated"),
    "checkpoint": dict(blocking_s=0.02, total_s=0.14, bytes=2408952, path="/w/checkpoints/33"),
    "resume": dict(from_step=33, data_epoch=1, data_step_in_epoch=11, directory="/w/ck",
                   changed_keys=["mesh"]),
}  # fmt: skip


def test_every_event_round_trips_through_its_line(tmp_path):
    assert set(SAMPLES) == set(rr.EVENTS)  # a new event needs a sample here
    path = tmp_path / "metrics.jsonl"
    written = [rr.make(e, **COMMON, **values) for e, values in SAMPLES.items()]
    path.write_text("".join(rr.to_line(r) for r in written))
    read, offset = rr.read_records(str(path))
    assert read == written and offset == path.stat().st_size
    for rec, (event, values) in zip(read, SAMPLES.items()):
        assert type(rec) is rr.EVENTS[event] and rec.extra == {}
        # the line is today's: the common fields first, then the event's in their order
        assert list(rr.to_dict(rec).items()) == list(({"event": event} | COMMON | values).items())


def test_unset_optional_fields_stay_out_of_the_line_and_required_ones_in():
    rec = rr.make("train", step=1, epoch=0.1, wall_s=None, loss=None, lr=0.1)
    assert rr.to_dict(rec) == {"event": "train", "step": 1, "epoch": 0.1, "wall_s": None,
                               "loss": None, "lr": 0.1}  # fmt: skip
    with pytest.raises(TypeError, match="lossy"):  # a misspelt field fails where it is written
        rr.make("train", step=1, epoch=0.1, wall_s=1.0, lossy=0.5, lr=0.1)


def test_a_line_cut_short_by_a_kill_is_skipped_and_the_rest_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [rr.to_line(rr.make("train", **COMMON, **SAMPLES["train"])) for _ in range(3)]
    whole = "".join(lines[:2]) + "not json\n" + "[1, 2]\n"
    path.write_text(whole + lines[2][:25])  # the writer died mid-line
    read, offset = rr.read_records(str(path))
    assert [r.event for r in read] == ["train", "train"] and offset == len(whole)
    # a reader that follows the file (the evaluator) picks the line up once it is whole
    path.write_text(whole + lines[2])
    more, end = rr.read_records(str(path), offset)
    assert [r.event for r in more] == ["train"] and end == path.stat().st_size
    assert rr.read_records(str(tmp_path / "none.jsonl")) == ([], 0)


def test_a_reader_that_asks_is_told_which_lines_did_not_read(tmp_path):
    """``unread`` gets, per whole line left out (blank ones aside), the index of the record
    after it; read_run counts them (``RunRecords.unread``) but for a killed start's cut line
    that its resume record follows. Without ``unread`` the records are the same. Planted
    bugs that fail it: read_run counting the killed start's line; blank lines counted."""
    line = rr.to_line(rr.make("train", **COMMON, **SAMPLES["train"]))
    resume = rr.to_line(rr.make("resume", **COMMON, from_step=33))
    path = tmp_path / "metrics.jsonl"
    path.write_text("not json\n" + line + "\n" + '{"event": "tr\n' + resume + line + "[1]\n")
    unread: list = []
    read, _ = rr.read_records(str(path), unread=unread)
    assert unread == [0, 1, 3] and read == rr.read_records(str(path))[0]
    assert [r.event for r in read] == ["train", "resume", "train"]
    assert rr.read_run(str(tmp_path)).unread == 2  # the line before the resume: a kill's


def test_a_file_of_another_version_reads_and_keeps_what_it_carries(tmp_path):
    """Lines as today's trainer wrote them, an older train line without momentum, one with a
    field this version does not know and an event it does not know."""
    old = [
        {"event": "data", "step": 0, "epoch": 0.0, "wall_s": 3.6, "source": "digits",
         "train_examples": 1437, "eval_examples": 360},
        {"event": "stage", "step": 0, "epoch": 0.0, "wall_s": 11.9, "stage": 0, "image_size": 32,
         "global_batch": 64, "min_scale": 0.08, "steps": 330, "data_parallel": 8},
        {"event": "train", "step": 29, "epoch": 1.3182, "wall_s": 17.4, "loss": 2.21, "lr": 0.1,
         "images_per_s": 335.2, "image_size": 32, "global_batch": 64, "stage": 0},
        {"event": "train", "step": 53, "epoch": 2.4, "wall_s": 22.6, "loss": 1.67, "lr": 0.09,
         "momentum": 0.9, "input_wait_s": 0.3},
        {"event": "eval", "step": 66, "epoch": 3.0, "wall_s": 25.0, "split": "test",
         "loss": 1.33, "top1": 0.61, "top5": 0.98, "examples": 360},
        {"event": "goodbye", "step": 66, "why": "a later version's event"},
    ]  # fmt: skip
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in old))
    read, _ = rr.read_records(str(path))
    assert [type(r).__name__ for r in read] == ["Data", "Stage", "Train", "Train", "Eval", "Record"]
    assert read[2].momentum is None and read[2].lr == 0.1 and read[1].data_parallel == 8
    assert read[3].extra == {"input_wait_s": 0.3} and read[4].top1 == 0.61
    assert read[5].event == "goodbye" and read[5].extra == {"why": "a later version's event"}
    assert [rr.to_dict(r) for r in read] == [old[0], old[1], old[2], old[3], old[4],
                                             {**old[5], "epoch": None, "wall_s": None}]  # fmt: skip


def test_the_atomic_write_leaves_the_old_file_whole_when_it_fails(tmp_path):
    path = str(tmp_path / "summary.json")
    rr.write_json(path, {"steps": 1})
    with pytest.raises(TypeError):
        rr.write_json(path, {"steps": 2, (1, 2): "a key JSON has not"})
    assert rr.read_json(path) == {"steps": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    rr.write_json(path, {"steps": 3})
    assert rr.read_json(path) == {"steps": 3} and rr.read_json(path + ".no") is None


def test_a_json_record_that_does_not_read_says_its_readers_fix(tmp_path):
    """summary.json cut short: the trainer's advice by default (it would overwrite the
    run), a reader's own where it passes one (NAME: the file's name), through read_run too.
    Planted bug that fails it: read_run not passing its ``unreadable`` on."""
    from hybridpar.config.errors import WorkdirError

    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "summary.json").write_text('{"steps": 1')
    path = str(tmp_path / "summary.json")
    with pytest.raises(WorkdirError, match="; move it away to start over$"):
        rr.read_json(path)
    with pytest.raises(WorkdirError, match=r"; set summary\.json\.bad aside$"):
        rr.read_run(str(tmp_path), unreadable="set NAME.bad aside")
