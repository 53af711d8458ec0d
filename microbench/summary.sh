# Sourced by the scripts that run a results call (from the repository root): OUT (default .), S, its
# summary.txt, and R, its raw/ folder for every command's output; `el LINE` stamps LINE with the seconds
# since sourcing and appends it to the summary.
OUT=${OUT:-.}
S=$OUT/summary.txt R=$OUT/raw
mkdir -p "$R"
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$S"; }
