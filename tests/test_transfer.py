"""The char-wide replication beside char-study (nanogeo/lab/study/transfer.py): each plan
hypothesis's outcome and each pick's verdict follow from the records, on planted differences."""
import json

from nanogeo.lab.study import plan, transfer
from nanogeo.lab.study.cli import main as study_main

WIRE = {"fp32": 1.0, "bf16": 0.5, "fp8": 0.262, "subspace": 0.263, "fp8-paper": 0.25,
        "geofp8-paper": 0.26, "nvfp4-e4m3s2-ef1": 0.205, "nvfp4-ef12": 0.146}


def record(preset, comm, seed, loss):
    return {"comm": comm, "optimizer": "muon", "workers": 32, "simulated": True, "seed": seed,
            "flags": [f"--preset={preset}"], "machine": "m", "preset": preset,
            "final_val_loss": loss, "tail_val_loss": loss + 0.001,
            "mean_wire_vs_bf16": WIRE[comm]}


def records(preset, gaps, seeds=range(12, 24)):
    """Every arm at fp32's loss plus its planted gap (and a small seed-to-seed wobble)."""
    out = []
    for s in seeds:
        base = 1.5 + 0.01 * (s % 5)
        for comm, gap in gaps.items():
            out.append(record(preset, comm, s, base + gap + 0.0002 * ((s * len(comm)) % 3 - 1)))
    return out


STUDY = {"fp32": 0, "bf16": 0.0005, "fp8": 0.003, "subspace": 0.0005, "fp8-paper": 0.04,
         "geofp8-paper": 0.04, "nvfp4-e4m3s2-ef1": 0.0006, "nvfp4-ef12": 0.008}
# on the wider model: the rotation loses to fp8 (reversed), the published method is harmless
WIDE = dict(STUDY, fp8=0.0, subspace=0.006, **{"fp8-paper": 0.02, "geofp8-paper": 0.0002})


def test_transfer_states_each_outcome_on_both_models():
    study, wide = records("char-study", STUDY), records("char-wide", WIDE)
    text = transfer.transfer(study, wide, (32,))
    row = {line.split(":")[0].lstrip("| "): line for line in text.splitlines()
           if line.startswith("| H")}
    cells = lambda h: [c.strip() for c in row[h].split("|")[1:-1]]
    # char-study's words come from its own plan (H3: "FP8 geometry"), else say "exploratory"
    assert cells("H3")[4] == "shown" and cells("H3")[7] == "reversed"    # char-study, char-wide
    assert cells("H1a")[4] == "exploratory: above 0" and cells("H1a")[7] == "shown"
    assert "unadjusted" in cells("H1b")[3] and cells("H1b")[7] == "not shown"
    assert cells("H2")[7] == "equivalent within ±0.002"
    assert cells("H4b")[7] == "reported (no test)"
    assert cells("H3")[6] == 'Holm p < 0.001 ("char-wide")'
    assert "`subspace` — reversed (fp8, geofp8-paper lower, Holm p < 0.05)" in text
    assert "`nvfp4-ef12` — held by default (the only 4-bit arm run on char-wide)" in text
    line = " ".join(transfer.transfer_line(study, wide).split())     # (wrapped in lines)
    assert "12 seeds, as planned" in line and "H3 reversed" in line
    assert cells("H2")[4] == "exploratory: not shown"       # char-study: no plan row for H2


def test_transfer_interim_and_not_run():
    """Fewer seeds than planned: said in the row and the line; an arm not run: said so."""
    study = records("char-study", STUDY)
    wide = records("char-wide", {k: v for k, v in WIDE.items() if k != "geofp8-paper"},
                   seeds=range(12, 16))
    text = transfer.transfer(study, wide, (32,))
    h3 = next(line for line in text.splitlines() if line.startswith("| H3"))
    assert "interim: 4 of 12 seeds" in h3 and "reversed (interim)" in h3
    h1b = next(line for line in text.splitlines() if line.startswith("| H1b"))
    assert h1b.count("not run") >= 2
    assert "interim: 4 of 12 seeds" in " ".join(transfer.transfer_line(study, wide).split())


def test_transfer_blocks_are_written_by_the_study_command(tmp_path):
    study, wide = tmp_path / "study.json", tmp_path / "wide.json"
    study.write_text(json.dumps(records("char-study", STUDY)))
    wide.write_text(json.dumps(records("char-wide", WIDE)))
    page = tmp_path / "page.md"
    page.write_text("<!-- transfer: begin -->\n<!-- transfer: end -->\n"
                    "<!-- transfer line: begin -->\n<!-- transfer line: end -->\n"
                    "<!-- machines: begin -->\n<!-- machines: end -->\n")
    study_main(["--answer", str(study), "--transfer", str(wide), "--readme", str(page)])
    content = page.read_text()
    assert content.count("| H3: subspace − fp8") == 1 and "On the wider char-wide" in content
    assert all(r.preset == "char-wide" for r in transfer.hypotheses(plan.read()))
