"""``kill_points.ON_KILL`` runs at the armed hit, just before the SIGKILL, and at no other hit
(Note [kill points]: the kill-point benchmark takes the whole node down from it, its
``--lose node``). One subprocess: the armed hit kills it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_on_kill_runs_at_the_armed_hit_only_then_the_process_dies(tmp_path):
    marks = tmp_path / "marks"
    code = (
        "import sys\n"
        "from zeroshard.testing import kill_points\n"
        "kill_points.ON_KILL = lambda: open(sys.argv[1], 'a').write('on_kill\\n')\n"
        "kill_points.hit('save', 3)\n"  # (the 1st hit of save in step 3: not the armed 2nd)
        "open(sys.argv[1], 'a').write('after the 1st hit\\n')\n"
        "kill_points.hit('save', 3)\n"
        "open(sys.argv[1], 'a').write('after the 2nd hit\\n')\n")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), RANK="0",
               ZEROSHARD_TEST_KILL_AT="save:3:0:2")
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    out = subprocess.run([sys.executable, "-c", code, str(marks)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    assert marks.read_text().splitlines() == ["after the 1st hit", "on_kill"]
