"""What a sequence leaves on the device between steps: KV caches, hidden states, slots."""
