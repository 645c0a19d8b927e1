# Sourced by the device scripts from session 10 on (bench/calls/gpu_session*.sh): unbuffered Python, inductor's and
# Triton's caches under /tmp/ind (filled from each group of chunks .ind/NAME.txz.* when .ind was carried), the
# output folder, and `drop`, a filter for the warnings that fill a compile's log. Earlier scripts repeat these lines
# themselves.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind/inductor TRITON_CACHE_DIR=/tmp/ind/triton
O=${OUT:-/tmp}
mkdir -p /tmp/ind && for g in .ind/*.txz.aa; do [ -e "$g" ] && cat "${g%aa}"* | xz -d | tar x -C /tmp/ind; done
B2=config/models/bench_2b.json
drop() { grep -v "Loading weights" | grep -v -i "warn\|online softmax\|split the\|important use case\|softmax\.$\|^$\|originates\|rope_inv_freq\|^ *\^*$\|File \"/work\|^E1201"; }
{ nvidia-smi -L; git log -1 --oneline; git status --short | head; } > $O/log.txt
# step NAME SECONDS CMD...: CMD's output goes straight to $O/NAME.raw, which comes back even when the call is cut
# (session 10's calls 2 and 3 lost theirs in the buffers of a `| grep | cut` pipeline); then drop's view of it, with
# the exit status and the start and end times, in $O/NAME.txt. KILL 15 s after the TERM (from session 11 on): the
# trainer finishes its step on TERM (faults.Preemption), which held session 11's call 2 to its limit while compiling
step() { local n=$1 t=$2; shift 2; { date +%T; timeout -k 15 "$t" "$@" > "$O/$n.raw" 2>&1; echo "rc $?"; drop < "$O/$n.raw" | cut -c1-220; date +%T; } > "$O/$n.txt"; }
