"""The CPU daemon never imports Triton (~70 MB of RSS); the Triton kernels import it at launch."""

from __future__ import annotations

import subprocess
import sys


def test_the_cpu_path_does_not_import_triton() -> None:
    script = (
        "import sys, torch\n"
        "import agentd.server.app\n"
        "from agentd.kernels import get_attention_backend\n"
        "from agentd.kernels.prefill_attention import torch_prefill_attention\n"
        "assert get_attention_backend('auto', torch.device('cpu')).name == 'cpu'\n"
        "q = torch.randn(5, 4, 16)\n"
        "kv = torch.randn(4, 2, 4, 2, 16)\n"
        "torch_prefill_attention(q, kv, torch.tensor([[0, 1]], dtype=torch.int32),\n"
        "                        torch.tensor([0, 5], dtype=torch.int32),\n"
        "                        torch.tensor([5], dtype=torch.int32), 0.25)\n"
        "print('triton' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, check=True)
    assert result.stdout.strip() == "False"
