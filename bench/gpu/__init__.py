"""GPU checks and figures: `bench/gpu/check.sh [--standin] OUTDIR` (see bench/README.md)."""
