"""llama-perplexity run by hand, as a user would, to hold kvexp's teacher-forced KL divergence to: the f16
KV cache's logits saved once, then a KV dtype's mean KLD against them (512-token context, 4 chunks, the
evaluation text kvexp ships)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Optional

from conftest import ROOT

from kvexp.assets.install import find_llama_perplexity


class ByHand:
    def __init__(self, llama_server: Path, model: Path, base: Path):
        self.ppl = find_llama_perplexity(llama_server)
        self.base = base
        threads = str(max(1, (os.cpu_count() or 2) - 1))
        self.same = ["-m", str(model), "-f", str(ROOT / "kvexp" / "assets" / "evaltext.txt"), "-c", "512",
                     "--chunks", "4", "-fa", "on", "-t", threads]
        subprocess.run([str(self.ppl), *self.same, "-ctk", "f16", "-ctv", "f16", "--kl-divergence-base", str(base)],
                       check=True, capture_output=True, timeout=600)

    def kld(self, dtype: str, env: Optional[dict[str, str]] = None) -> float:
        """The mean KLD of KV dtype `dtype` (K and V) against the f16 logits, as llama-perplexity prints it."""
        out = subprocess.run([str(self.ppl), *self.same, "-ctk", dtype, "-ctv", dtype, "--kl-divergence-base",
                              str(self.base), "--kl-divergence"], capture_output=True, text=True, timeout=600,
                             env={**os.environ, **(env or {})}).stdout
        return float(re.search(r"Mean\s+KLD:\s+(-?[\d.]+)", out).group(1))
