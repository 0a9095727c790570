import sys
from pathlib import Path

# training/ sits beside the package (not installed); nemo_oracle lives in tests/models.
_ROOT = Path(__file__).resolve().parents[2]
for path in (_ROOT, _ROOT / "tests" / "models"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
