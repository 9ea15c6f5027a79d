"""What turns stored bytes into checked, decoded samples: checksums (host and device kernel), verification
of windows, decoding on CPU threads and on the GPU (nvCOMP). Never reads a file: bytes are handed to it."""
