"""The autotuning service: tuner (plain Python), servicer (gRPC adapter), server and CLI."""
