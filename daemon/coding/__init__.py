"""ParM coded resilience: parity codes shared by training and serving, and the parity trainer."""
