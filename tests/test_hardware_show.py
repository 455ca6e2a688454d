"""`slidedp hardware list` and `slidedp hardware show` through the real CLI."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from slidedp.spec.hardware import hardware_presets, preset_dir


def run(*args):
    return subprocess.run([sys.executable, "-m", "slidedp.cli", *args], capture_output=True,
                          text=True)


def test_list_is_one_header_line_then_one_preset_a_line_name_first():
    out = run("hardware", "list")
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.strip().splitlines()
    assert header.split()[0] == "name" and "sockets" in header
    assert [r.split()[0] for r in rows] == hardware_presets()


def test_show_names_sockets_switches_and_gpus_and_draws_a_png(tmp_path):
    png = tmp_path / "a800x8.png"
    out = run("hardware", "show", "a800x8", "--plot", str(png))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for words in ("socket 0", "socket 1", "switch 1", "GPU 3 under switch 0 on socket 0",
                  "GPU 7 under switch 2 on socket 1", "NVLink bridges 0-1, 2-3, 4-5, 6-7",
                  "below a common switch", "all GPUs at once: 34.8 GB/s H2D"):
        assert words in text, words
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_show_of_a_flat_file_says_it_is_the_one_switch_case(tmp_path):
    text = (preset_dir() / "h200x2.toml").read_text()
    flat = tmp_path / "flat.toml"
    flat.write_text(text[:text.index("\n[topology]")] + "\n")
    assert "topology" not in tomllib.loads(flat.read_text())
    out = run("hardware", "show", str(flat))
    assert out.returncode == 0, out.stderr
    assert "no [topology] table" in out.stdout
    assert "GPU 1 under switch 0 on socket 0" in out.stdout
