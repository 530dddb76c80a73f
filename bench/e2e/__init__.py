"""The model, peer and serving benches (bench/README.md): model.py (SmolLM2 against llama.cpp; `python -m
bench.e2e`), big.py (real shapes), peer.py (the llama-cpp-python side), bigmodels.py (the synthetic
files), serve.py and load.py (the servers under load), profile.py (where a token's time goes),
constrained_ab.py. They share bench/timing.py."""
