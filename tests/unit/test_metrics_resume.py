"""metrics.jsonl across a resume (issue 46, case 13): what the resumed run records again moves to
metrics.superseded.jsonl, so that each step and each tau is in metrics.jsonl once; nothing is deleted."""
import json

from dflash_dist.observe.monitor import SUPERSEDED, set_aside_records


def test_records_a_resume_redoes_move_aside_and_the_rest_stays_in_order(tmp_path):
    path = tmp_path / "metrics.jsonl"
    recs = [{"kind": "plan", "step": 0}, {"kind": "tau", "step": 0}, *({"kind": "step", "step": s} for s in range(1, 9)),
            {"kind": "tau", "step": 6}, {"kind": "note"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs[:9]) + "not json\n"
                    + "".join(json.dumps(r) + "\n" for r in recs[9:]) + '{"kind": "step", "st')  # a cut last line
    moved = set_aside_records(path, lambda r: r.get("step", -1) > 6 or (r.get("kind") == "tau" and r["step"] == 6))
    assert [(r["kind"], r["step"]) for r in moved] == [("step", 7), ("step", 8), ("tau", 6)]
    lines = path.read_text().splitlines()
    assert lines[-2:] == ['{"kind": "note"}', '{"kind": "step", "st']  # bad lines stay where they were
    kept = [json.loads(x) for x in lines if x.startswith("{") and x.endswith("}")]
    assert kept == [r for r in recs if r not in moved]
    assert [json.loads(x) for x in (tmp_path / SUPERSEDED).read_text().splitlines()] == moved
    assert set_aside_records(path, lambda r: False) == [] and set_aside_records(tmp_path / "none", bool) == []
