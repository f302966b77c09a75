"""Accelerator memory: copies of a save from device memory into the RAM tier, and restores back, through page-locked buffers."""
