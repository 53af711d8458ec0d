# shape_tree.sh DIR THREADS ROWS BLOCKS: a copy of this tree in DIR whose matrix-vector kernels have THREADS
# threads a block, ROWS rows a wave and a bound of BLOCKS blocks a multiprocessor (gemv.cu and layout.py).
set -eu
mkdir -p "$1"
tar c --exclude=./.dev --exclude=./.git --exclude=./docs . | tar x -C "$1"
sed -i "s/^#define MOE_GEMV_THREADS 256$/#define MOE_GEMV_THREADS $2/; s/^#define MOE_GEMV_WAVE_ROWS 2 /#define MOE_GEMV_WAVE_ROWS $3 /; s/^#define MOE_GEMV_MIN_BLOCKS 4$/#define MOE_GEMV_MIN_BLOCKS $4/" "$1/expertstream/kernels/gemv.cu"
sed -i "s/^GEMV_THREADS = 256 /GEMV_THREADS = $2 /; s/^GEMV_WAVE_ROWS = 2 /GEMV_WAVE_ROWS = $3 /" "$1/expertstream/kernels/layout.py"
grep -c "^#define MOE_GEMV_THREADS $2$\|^#define MOE_GEMV_WAVE_ROWS $3 \|^#define MOE_GEMV_MIN_BLOCKS $4$" "$1/expertstream/kernels/gemv.cu"
grep -c "^GEMV_THREADS = $2 \|^GEMV_WAVE_ROWS = $3 " "$1/expertstream/kernels/layout.py"
