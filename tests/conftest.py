import os
import sys

# helper modules (engine_helpers, testing_proposers, ...) import by bare name, here and in worker processes
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
