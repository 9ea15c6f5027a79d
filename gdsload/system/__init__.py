"""What this machine is: GPU, CUDA, KvikIO and GDS probes, /proc and /sys parsed, NUMA placement.
Probes import GPU packages inside functions and report what they found or why not, never a guess."""
