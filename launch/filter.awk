# The filter of what torchrun and its ranks write to stderr (launch/common.sh's run_or_print; awk -v notes=FILE).
# It shows everything as it comes except torchrun's own report: its traceback (with its chained causes) when
# signalled (SignalException), when a rank failed (ChildFailedError and the failures block) or when it lost node
# 0's rendezvous store (RendezvousConnectionError, with c10d's store warnings and their C++ frames), and its
# "Sending process ... closing signal" / "failed (exitcode ...)" lines; and notes for the summary, as they happen:
# `sig N` (torchrun got signal N), `fail RANK CODE ROOT` (torchrun's report; ROOT=1: its "first observed"),
# `rdzv connect|lost` (node 0's store never answered / closed), `restart` (only if torchrun logs at INFO),
# `err LINE` (the ranks' `error: ...` lines; `errs` starts a block), `out` (a line after them). The other ranks print
# their errors too, as `error: rank N: ...` (training/errors.py, EVERY_RANK): such a line waits until torchrun ends
# and is shown only if no rank said the same without the prefix: an error raised on every rank is said once (by
# rank 0), one raised on rank N alone is not lost.
function note(s) { print s >> notes; fflush(notes) }
function flush_held(  i) { for (i = 1; i <= held; i++) show(hold[i]); held = 0 }
function said_as(line) { sub(/^error: (rank [0-9]+: )?/, "", line); return line }
function show(line) {
  print line; fflush()
  if (line ~ /^error: /) { said[said_as(line)] = 1; if (!inerr) note("errs"); note("err " line); inerr = 1; after = 0 }
  else if (inerr || !after) { if (inerr) note("out"); inerr = 0; after = 1 }
}
function flush_ranks(  i) {  # the other ranks' errors that no rank said without the prefix
  for (i = 1; i <= ranked; i++) if (!(said_as(rank_err[i]) in said)) show(rank_err[i])
  ranked = 0; split("", waiting)
}
function lost_store(  i, how) {  # torchrun's RendezvousConnectionError: its report and the store's warnings dropped
  how = "lost"
  for (i = 1; i <= held; i++) if (hold[i] ~ /while trying to connect to|failed to connect/) how = "connect"
  note("rdzv " how); held = 0; noisy = 0; mode = ""
}
# c10d's warnings when the store goes away ([W... TCPStore.cpp:N] [c10d] ..., then its C++ frames): held until
# torchrun ends; dropped if it ends with a lost store (the summary says it), else shown then
mode == "" && /^\[[WE][0-9]+ [0-9:.]+ (TCPStore|socket)\.cpp:[0-9]+\] \[c10d\] / { noise[++noisy] = $0; cpp = 1; next }
mode == "" && cpp && (/^Exception raised from / || /^frame #[0-9]+: / || /^<omitting python frames>$/ || $0 == "") {
  noise[++noisy] = $0; next
}
{ cpp = 0 }
/\] The node .* has failed to shutdown the rendezvous .* RendezvousConnectionError\.$/ { noise[++noisy] = $0; next }
mode == "" && /^Traceback \(most recent call last\):$/ { mode = "tb"; held = 0; hold[++held] = $0; next }
mode == "tb" {
  hold[++held] = $0
  if ($0 ~ /^  File "<frozen runpy>"/) next
  # torchrun's: its main (torch/distributed/run.py) or a cause raised in its elastic agent, chained to it
  if ($0 ~ /^  File ".*torch\/distributed\/(run\.py|elastic\/)/) { mode = "torchrun"; next }
  mode = ""; flush_held(); next  # a rank's traceback: shown
}
mode == "cause" {  # after an exception line of torchrun's: the chain goes on, or that was its last line
  if ($0 == "" || $0 ~ /^(The above exception was the direct cause|During handling of the above exception)/) {
    hold[++held] = $0; if ($0 != "") mode = "torchrun"; next
  }
  mode = ""; flush_held()  # torchrun failed itself (rendezvous, ...): shown; this line goes on below
}
mode == "torchrun" {
  if ($0 ~ /^[ \t]/ || $0 == "" || $0 ~ /^Traceback \(most recent call last\):$/) { hold[++held] = $0; next }
  if ($0 ~ /SignalException: .* got signal: [0-9]+$/) { note("sig " $NF); mode = ""; held = 0; next }
  if ($0 ~ /ChildFailedError:/) { mode = "report"; root = 0; held = 0; next }
  if ($0 ~ /RendezvousConnectionError: /) { lost_store(); next }
  hold[++held] = $0; mode = "cause"; next
}
mode == "report" {
  if ($0 ~ /^Root Cause/) root = 1
  else if ($1 == "rank" && $2 == ":") rank = $3
  else if ($1 == "exitcode" && $2 == ":") note("fail " rank " " $3 " " root)
  else if (root && $0 ~ /^=+$/) mode = ""
  next
}
/\] Sending process [0-9]+ closing signal / || /\] failed \(exitcode: -?[0-9]+\) local_rank: / { next }
/\] Received .* death signal, shutting down workers/ { next }
/will restart worker group/ { flush_ranks(); note("restart") }
/^error: rank [1-9][0-9]*: / {
  k = said_as($0)
  if (!(k in said) && !(k in waiting)) { waiting[k] = 1; rank_err[++ranked] = $0 }
  next
}
{ show($0) }
END { flush_held(); for (i = 1; i <= noisy; i++) show(noise[i]); flush_ranks() }
