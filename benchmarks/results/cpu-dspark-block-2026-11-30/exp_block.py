"""The experiment of README.md, as run at commit 7588d48 (whose drafter ran a gamma-slot block): PATCH=1 runs
the whole trained block and keeps the first gamma slots, the behaviour the drafter has had since. Arguments go to
benchmarks/bench_drafts.py."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root

from baton.spec.dspark import DSparkDrafter  # noqa: E402
from benchmarks.bench_drafts import main  # noqa: E402

if os.environ.get("PATCH") == "1":
    gamma_block = DSparkDrafter.block_hidden

    def whole_block(self, anchor, anchor_pos):
        gamma, self.gamma = self.gamma, max(self.gamma, self.model.config.block_size)
        try:
            return gamma_block(self, anchor, anchor_pos)[:gamma]
        finally:
            self.gamma = gamma

    DSparkDrafter.block_hidden = whole_block

if __name__ == "__main__":
    main(sys.argv[1:])
