"""The report stage: what a run says about itself, beside the training it observes: the log
lines, metrics.jsonl and its summary, and the sinks fed the same records (TensorBoard, W&B,
MLflow), the slow rank named."""
