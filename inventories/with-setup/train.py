"""Placeholder trainer: replace with yours. It reads what provision wrote (TF_CONFIG)."""

import json
import os

print("task", json.loads(os.environ["TF_CONFIG"])["task"])
