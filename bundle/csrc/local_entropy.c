/*
 * Local histogram entropy (the IIE map of Sec. 3 step 1 of the paper) by a sliding histogram.
 *
 * For each output row (one (z, y) pair of a (nz, ny, nx) volume; nz = 1 in 2D) the window's histogram
 * slides along x: one column of kz x ky pixels leaves and one enters per pixel. The sum S = sum_b F(c_b)
 * is kept up to date from the differences F(c + 1) - F(c), where F(c) = round(c log2 c / unit) is an
 * integer (fixed point; the caller gives the table and its unit), so S is exact whatever the order of additions
 * and a window with one bin gives exactly 0. The entropy is H = (F(n) - S) unit / n bits, n the number of in-image
 * pixels of the window
 * (the window is cut at the borders and covers offsets -k/2 .. k - k/2 - 1 along each axis, as
 * skimage.filters.rank footprints do).
 *
 * Built on first use by bundle/kernels.py with the system C compiler and called through ctypes, which
 * releases the GIL: callers split the rows between threads.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* first and one-past-last in-image index of the window around i along an axis of length n */
static void window_range(int64_t i, int64_t k, int64_t n, int64_t *first, int64_t *last) {
    int64_t lo = i - k / 2, hi = i + k - k / 2;
    *first = lo < 0 ? 0 : lo;
    *last = hi > n ? n : hi;
}

/*
 * Entropy of rows [row_begin, row_end) (row r = z * ny + y) into out (nz * ny * nx floats, row-major).
 * bins: the pixels' histogram bins, each < n_bins. fixed_xlog2x: F(c) for c = 0 .. max_count, the most pixels a
 * window holds inside the image, in units of unit bits. Returns 0, or -1 when its work space cannot be allocated.
 */
int local_entropy_rows(const uint16_t *bins, int64_t nz, int64_t ny, int64_t nx, int64_t kz, int64_t ky,
                       int64_t kx, int64_t n_bins, const int64_t *fixed_xlog2x, int64_t max_count, double unit,
                       int64_t row_begin, int64_t row_end, float *out) {
    int64_t lines_max = (kz < nz ? kz : nz) * (ky < ny ? ky : ny);
    uint32_t *hist = calloc((size_t)n_bins, sizeof(uint32_t));
    int64_t *step = malloc((size_t)max_count * sizeof(int64_t));  /* F(c + 1) - F(c) */
    int64_t *offsets = malloc((size_t)lines_max * sizeof(int64_t));
    if (hist == NULL || step == NULL || offsets == NULL) {
        free(hist);
        free(step);
        free(offsets);
        return -1;
    }
    for (int64_t c = 0; c < max_count; c++) step[c] = fixed_xlog2x[c + 1] - fixed_xlog2x[c];
    for (int64_t row = row_begin; row < row_end; row++) {
        int64_t z = row / ny, y = row % ny, z0, z1, y0, y1, x0, x1;
        window_range(z, kz, nz, &z0, &z1);
        window_range(y, ky, ny, &y0, &y1);
        int64_t lines = 0;
        for (int64_t zz = z0; zz < z1; zz++)
            for (int64_t yy = y0; yy < y1; yy++) offsets[lines++] = (zz * ny + yy) * nx;
        memset(hist, 0, (size_t)n_bins * sizeof(uint32_t));
        int64_t sum = 0;
        window_range(0, kx, nx, &x0, &x1);
        for (int64_t col = x0; col < x1; col++)
            for (int64_t j = 0; j < lines; j++) sum += step[hist[bins[offsets[j] + col]]++];
        int64_t columns = x1 - x0;
        float *line = out + row * nx;
        for (int64_t x = 0; x < nx; x++) {
            int64_t n = columns * lines, entropy = fixed_xlog2x[n] - sum;
            line[x] = entropy > 0 ? (float)((double)entropy * unit / (double)n) : 0.0f;
            int64_t leave = x - kx / 2, enter = x + kx - kx / 2;
            if (leave >= 0) {
                for (int64_t j = 0; j < lines; j++) sum -= step[--hist[bins[offsets[j] + leave]]];
                columns--;
            }
            if (enter < nx) {
                for (int64_t j = 0; j < lines; j++) sum += step[hist[bins[offsets[j] + enter]]++];
                columns++;
            }
        }
    }
    free(hist);
    free(step);
    free(offsets);
    return 0;
}
