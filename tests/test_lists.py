"""Lists in the textbook files stay complete: every model preset is named in model.py's docstring
(with its size) and in train.py's --preset comment (directly or by a glob such as llama-*)."""
import fnmatch
import re

import model
from conftest import ROOT


def test_every_preset_is_listed_in_model_docstring_and_train_comment():
    listed = {line.split()[0] for line in model.__doc__.splitlines()
              if re.match(r"\s+\S+\s+~", line)}
    assert listed == set(model.PRESETS), (
        f"model.py's docstring lists {sorted(listed)}, model.PRESETS has {sorted(model.PRESETS)}")
    comment = next(line for line in open(f"{ROOT}/train.py") if line.strip().startswith("preset:"))
    names = re.findall(r"[a-z0-9]+-[a-z0-9*]+", comment.partition("#")[2])
    missing = [p for p in model.PRESETS if not any(fnmatch.fnmatch(p, n) for n in names)]
    assert not missing, f"train.py's preset comment omits {missing}"
