"""Console progress and run summaries (metrics.jsonl is written by train.outputs.RunDir)."""
