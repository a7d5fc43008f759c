"""Running the `registry` command as a user does (not a test module itself)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEADLINE = 60  # seconds any one command may take


@dataclass
class Ran:
    status: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)

    def error_line(self, status: int = 1) -> str:
        """The one line a failed command prints: exit status `status`, no traceback."""
        assert self.status == status, (self.status, self.stdout, self.stderr)
        assert "Traceback" not in self.stderr, self.stderr
        lines = self.stderr.splitlines()
        assert len(lines) == 1, self.stderr
        assert lines[0].startswith("registry: "), lines[0]
        return lines[0]


class Cli:
    """`python -m cli ...` in a subprocess, with its own session file and no REGISTRY_*
    variables from the environment."""

    def __init__(self, home: Path, url: str | None = None) -> None:
        self.home = home
        self.url = url
        self.session_file = home / "sessions.json"
        home.mkdir(parents=True, exist_ok=True)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}
        env["REGISTRY_SESSION_FILE"] = str(self.session_file)
        if self.url:
            env["REGISTRY_URL"] = self.url
        return env

    def __call__(self, *args: str | Path) -> Ran:
        done = subprocess.run(
            [sys.executable, "-m", "cli", *map(str, args)],
            capture_output=True,
            text=True,
            timeout=DEADLINE,
            check=False,
            cwd=self.home,
            env=self.env(),
        )
        return Ran(done.returncode, done.stdout, done.stderr)

    def ok(self, *args: str | Path) -> Ran:
        ran = self(*args)
        assert ran.status == 0, (args, ran.stdout, ran.stderr)
        assert "Traceback" not in ran.stderr, ran.stderr
        return ran

    def write(self, name: str, value: Any) -> Path:
        path = self.home / name
        path.write_text(value if isinstance(value, str) else json.dumps(value, indent=2))
        return path
