"""The runtime: the hands. Devices, executors, model programs and weight blocks."""
