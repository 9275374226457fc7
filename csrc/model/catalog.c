/* The GPU catalog: the one place where datasheet peaks and default efficiencies live, and the names a part goes by
 * (aliases, and the device names its driver reports). */
#include <ctype.h>
#include <string.h>

#include "internal.h"

/* Peaks are dense (no sparsity) tensor-core rates for bf16 inputs with fp32 accumulation, from NVIDIA's
 * datasheets and architecture whitepapers; memory is what the driver reports, in GiB.
 *
 * gemm_eff: large bf16 matmuls reach 70-80% of peak with cuBLAS on data-centre parts (e.g. about 790 of
 *   989 TFLOP/s for an 8192^3 bf16 product on H100/H200), less inside a training step where shapes are
 *   smaller and kernels wait on each other.
 * attn_eff: forward+backward flash attention (FlashAttention-2, head dim 128, long sequences).
 *   A100: Dao 2023, "FlashAttention-2", abstract: 50-73% of peak (up to ~230 TFLOP/s forward).
 *   H100: FA2 runs without Hopper instructions: 335-370 TFLOP/s forward at 16K, head dim 128
 *   (Shah et al. 2024, "FlashAttention-3", Fig. 5), about 35% of peak forward, less backward; FA3 reaches ~60%.
 * Hopper and Ampere data-centre parts: gemm_eff 0.55 and attn_eff 0.30 (Hopper) / 0.55 (Ampere), chosen on two
 *   thirds of 26 published measured runs (USP on A800, MosaicML FSDP on H100 and A100, ALST on H100;
 *   benchmarks/fidelity.py, benchmarks/results/fidelity.md): the large-GEMM and kernel figures above (0.70-0.78,
 *   0.35-0.66) left every run predicted 13-53% too fast, a median of 23%; with these the held-aside third is
 *   predicted within a median of 6%. The other parts have no published run in that table: their defaults are
 *   estimates, marked so, scaled by the factors the fitted parts moved by (gemm_eff x 0.79, attn_eff x 0.84) so
 *   that a mixed cluster's devices keep the ratios the estimates gave them.
 * attn_kernel names the attention kernel a user runs on each part (the one attn_eff stands for), with where it comes
 *   from; hexiseq's own CUDA kernels and torch's fused ops are chosen per device at run time (hexiseq.runtime.fused),
 *   which calibrate measures.
 * host_gbps is the host link per direction, from the PCIe generation each part's datasheet gives: 5.0 x16 = 64 GB/s
 *   (Hopper, H20 included; B200, which its x86 HGX hosts run at Gen5; MI300X, MI325X, Gaudi 3), 4.0 x16 = 32
 *   (Ampere, Ada, Gaudi 2; MI250X's GCDs an estimate, the module's link shared by two), 3.0 x16 = 16 (V100);
 *   Ascend 910B3 32, low confidence. A GB200 GPU reaches host memory over NVLink-C2C instead: the superchip's
 *   900 GB/s (both directions) shared by its two GPUs, 225 per GPU and direction, an estimate. Offloading prices
 *   copies at HEXISEQ_HOST_LINK_EFF of it unless calibrate measured the link.
 * memory_gib of the parts added later (H20, L20, B200, GB200, MI325X): H20 and B200 as nvidia-smi reports them,
 *   L20 as its GDDR6 siblings L40 and L40S report; GB200 and MI325X estimated from the datasheet size less the
 *   reserve their siblings show (B200: 180 GB, 179.1 GiB; MI300X: 192 GB, 191.7 GiB).
 * Blackwell (B200, GB200) and H20 take the fitted Hopper efficiencies, L20 the L40's (both Ada with half-rate fp32
 *   accumulation), MI325X the MI300X's (the same CDNA 3 compute): estimates, none with a published run.
 * Measured rates override every default through the cluster's per-node fields. */
/* The attention kernels of the entries below (attn_kernel). */
#define KERNEL_HOPPER "FlashAttention-2 (Dao 2023), which the published H100 runs attn_eff is fitted on ran (ALST " \
                      "states it; MosaicML's configurations use flash or triton); FlashAttention-3 (Shah et al. " \
                      "2024) and cuDNN SDPA run faster on Hopper (calibrate prices them)"
#define KERNEL_BLACKWELL "cuDNN SDPA (torch SDPA's cuDNN backend, Transformer Engine's fused attention); " \
                         "FlashAttention-2 runs on Blackwell without its tensor-core instructions and FlashAttention-3 " \
                         "needs Hopper (calibrate prices the kernel a device runs)"
#define KERNEL_AMPERE "FlashAttention-2 (Dao 2023, sm80 and later; torch SDPA's flash backend)"
#define KERNEL_ADA "FlashAttention-2 (Dao 2023; FlashAttention-3 needs Hopper)"
#define KERNEL_ROCM "FlashAttention-2 for ROCm (ROCm/flash-attention on composable_kernel; torch SDPA on ROCm)"
#define KERNEL_GAUDI "Intel Gaudi FusedSDPA (habana_frameworks.torch.hpex.kernels)"

static const hexiseq_gpu_spec catalog[] = {
    {"H100-SXM", 989.4, 79.6, 3350.0, 0.55, 0.30,
     "NVIDIA H100 datasheet (SXM5: 989 TFLOP/s bf16 dense, 80 GB HBM3, 3.35 TB/s)",
     KERNEL_HOPPER, 64.0},
    {"H100-PCIe", 756.5, 79.6, 2000.0, 0.55, 0.30,
     "NVIDIA H100 datasheet (PCIe: 756 TFLOP/s bf16 dense, 80 GB HBM2e, 2.0 TB/s)",
     KERNEL_HOPPER, 64.0},
    {"H200", 989.4, 140.4, 4800.0, 0.55, 0.30,
     "NVIDIA H200 datasheet (SXM: 989 TFLOP/s bf16 dense, 141 GB HBM3e, 4.8 TB/s)",
     KERNEL_HOPPER, 64.0},
    {"H800", 989.4, 79.6, 3350.0, 0.55, 0.30,
     "NVIDIA H800 SXM5 product brief (same compute as H100 SXM5, 80 GB, 3.35 TB/s)",
     KERNEL_HOPPER, 64.0},
    {"H20", 148.0, 95.6, 4000.0, 0.55, 0.30,
     "NVIDIA HGX H20 specification (148 TFLOP/s bf16 dense, 96 GB HBM3, 4.0 TB/s); nvidia-smi reports 97,871 MiB "
     "= 95.6 GiB; efficiencies estimated (Hopper's)",
     KERNEL_HOPPER, 64.0},
    {"B200", 2250.0, 179.1, 8000.0, 0.55, 0.30,
     "NVIDIA HGX B200 and DGX B200 datasheets (per GPU: 2.25 PFLOP/s bf16 dense, 4.5 with sparsity; 180 GB "
     "HBM3e, 8 TB/s); nvidia-smi reports 183,359 MiB = 179.1 GiB; efficiencies estimated (Hopper's)",
     KERNEL_BLACKWELL, 64.0},
    {"GB200", 2500.0, 185.1, 8000.0, 0.55, 0.30,
     "NVIDIA GB200 NVL72 datasheet (per Blackwell GPU, half a superchip: 2.5 PFLOP/s bf16 dense, 5 with "
     "sparsity; 186 GB HBM3e, 8 TB/s); memory_gib and the NVLink-C2C host link estimated; efficiencies estimated "
     "(Hopper's)",
     KERNEL_BLACKWELL, 225.0},
    {"A100-40G", 312.0, 40.0, 1555.0, 0.55, 0.55,
     "NVIDIA A100 datasheet (312 TFLOP/s bf16 dense, 40 GB HBM2, 1.56 TB/s)",
     KERNEL_AMPERE, 32.0},
    {"A100-80G", 312.0, 80.0, 2039.0, 0.55, 0.55,
     "NVIDIA A100 datasheet (SXM: 312 TFLOP/s bf16 dense, 80 GB HBM2e, 2.04 TB/s)",
     KERNEL_AMPERE, 32.0},
    {"A800", 312.0, 80.0, 2039.0, 0.55, 0.55,
     "NVIDIA A800 SXM4 product brief (same compute as A100 80GB, 2.04 TB/s)",
     KERNEL_AMPERE, 32.0},
    {"L40S", 362.1, 45.0, 864.0, 0.51, 0.42,
     "NVIDIA L40S datasheet (362 TFLOP/s bf16 dense, 48 GB GDDR6, 864 GB/s); attn_eff estimated",
     KERNEL_ADA, 32.0},
    {"L40", 181.0, 45.0, 864.0, 0.55, 0.46,
     "NVIDIA L40 datasheet (181 TFLOP/s bf16 dense, 48 GB GDDR6, 864 GB/s); attn_eff estimated",
     KERNEL_ADA, 32.0},
    {"L20", 119.5, 45.0, 864.0, 0.55, 0.46,
     "NVIDIA L20 datasheet (119.5 TFLOP/s bf16 dense, 239 with sparsity, 48 GB GDDR6, 864 GB/s); memory_gib as "
     "L40 reports it; efficiencies estimated (L40's)",
     KERNEL_ADA, 32.0},
    {"A6000", 154.8, 48.0, 768.0, 0.55, 0.46,
     "NVIDIA RTX A6000 datasheet (309.7 sparse = 154.8 dense TFLOP/s, 48 GB, 768 GB/s); attn_eff estimated",
     KERNEL_AMPERE, 32.0},
    {"RTX4090", 165.2, 24.0, 1008.0, 0.55, 0.46,
     "NVIDIA Ada whitepaper (RTX 4090: 165.2 TFLOP/s fp16/bf16 with fp32 accumulate, 24 GB, 1008 GB/s)",
     KERNEL_ADA, 32.0},
    {"RTX3090", 71.0, 24.0, 936.0, 0.55, 0.46,
     "NVIDIA Ampere GA102 whitepaper (RTX 3090: 71 TFLOP/s fp16/bf16 with fp32 accumulate, 24 GB, 936 GB/s)",
     KERNEL_AMPERE, 32.0},
    {"V100", 125.0, 31.7, 900.0, 0.55, 0.34,
     "NVIDIA V100 datasheet (SXM2 32GB: 125 TFLOP/s fp16 tensor, no bf16, 900 GB/s); attn_eff estimated",
     "memory-efficient attention (xformers, torch SDPA's efficient backend): FlashAttention-2 needs sm80", 16.0},
    /* Other vendors' accelerators. Their efficiencies are estimates (no published run in
     * benchmarks/data/published_runs.yaml), as for the NVIDIA parts without one; the hexiseq CUDA kernels do not
     * run on them, the planner and cost model do. */
    {"MI300X", 1307.4, 191.7, 5300.0, 0.50, 0.30,
     "AMD CDNA 3 white paper (MI300X: 1307.4 TFLOP/s bf16 dense, 192 GB HBM3, 5.3 TB/s); rocm-smi reports "
     "191.7 GiB; efficiencies estimated",
     KERNEL_ROCM, 64.0},
    {"MI325X", 1307.4, 255.7, 6000.0, 0.50, 0.30,
     "AMD Instinct MI325X datasheet (1307.4 TFLOP/s bf16 dense, 256 GB HBM3E, 6 TB/s); memory_gib estimated "
     "from MI300X's reserve; efficiencies estimated (MI300X's)",
     KERNEL_ROCM, 64.0},
    {"MI250X-GCD", 191.5, 64.0, 1638.4, 0.50, 0.30,
     "AMD CDNA 2 white paper (MI250X: 383 TFLOP/s bf16 dense, 128 GB HBM2e, 3.2768 TB/s per module of two "
     "GCDs, each its own device to ROCm: half of each); efficiencies estimated",
     KERNEL_ROCM, 32.0},
    {"Gaudi2", 432.0, 96.0, 2460.0, 0.50, 0.30,
     "Intel, Hot Chips 2024 (Gaudi 2: 432 TFLOP/s bf16, 96 GB HBM2e, 2.46 TB/s); hl-smi reports 96 GiB; "
     "efficiencies estimated",
     KERNEL_GAUDI, 32.0},
    {"Gaudi3", 1835.0, 128.0, 3670.0, 0.50, 0.30,
     "Intel, Hot Chips 2024 (Gaudi 3: 1835 TFLOP/s bf16, 128 GB HBM2e, 3.67 TB/s; a later Intel figure of 1678 "
     "is reported, not verified); efficiencies estimated",
     KERNEL_GAUDI, 64.0},
    {"Ascend910B3", 313.0, 64.0, 1600.0, 0.50, 0.30,
     "Huawei Atlas 800T A2 specification in MindStudio (910B3: 313 TFLOP/s fp16, 64 GB HBM2e); 1.6 TB/s from "
     "third-party reports, no Huawei datasheet read: low confidence; fp16 taken for bf16; efficiencies estimated",
     "torch_npu npu_fusion_attention (Ascend FlashAttentionScore operator)", 32.0},
};

#define CATALOG_SIZE ((int)(sizeof catalog / sizeof catalog[0]))

/* Short names people type for the common parts. */
static const struct {
    const char *alias, *name;
} aliases[] = {
    {"H100", "H100-SXM"}, {"H100-80G", "H100-SXM"}, {"A100", "A100-80G"}, {"A800-80G", "A800"},
    {"RTX-4090", "RTX4090"}, {"RTX-3090", "RTX3090"}, {"RTX-A6000", "A6000"}, {"V100-32G", "V100"},
    {"MI250X", "MI250X-GCD"}, {"Gaudi-2", "Gaudi2"}, {"Gaudi-3", "Gaudi3"}, {"Ascend-910B3", "Ascend910B3"},
    {"H20-96G", "H20"}, {"B200-180G", "B200"},
};

/* The parts as their driver names them (CUDA's device name, as torch.cuda.get_device_name and nvidia-smi give it:
 * "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-40GB"): a lower-case piece of the name and the
 * catalog model it stands for. The first piece found in the name wins, so a piece comes before any shorter one it
 * contains ("h100 pcie" before "h100", "a100-sxm4-40" before "a100", "l40s" before "l40"). */
static const struct {
    const char *piece, *name;
} device_names[] = {
    {"h100 pcie", "H100-PCIe"},   {"h100", "H100-SXM"},         {"h200", "H200"},     {"h800", "H800"},
    {"a100-sxm4-40", "A100-40G"}, {"a100-pcie-40", "A100-40G"}, {"a100", "A100-80G"}, {"a800", "A800"},
    {"l40s", "L40S"},             {"l40", "L40"},               {"a6000", "A6000"},   {"4090", "RTX4090"},
    {"3090", "RTX3090"},          {"v100", "V100"},
};

int hexiseq_gpu_catalog_size(void) { return CATALOG_SIZE; }

int hexiseq_gpu_alias_count(void) { return (int)(sizeof aliases / sizeof aliases[0]); }

hexiseq_status hexiseq_gpu_alias_get(int index, const char **alias, const char **name) {
    hexiseq_clear_error();
    if (!alias || !name)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "alias and name must not be NULL");
    if (index < 0 || index >= hexiseq_gpu_alias_count())
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "alias index must be in [0, %d), got %d", hexiseq_gpu_alias_count(),
                            index);
    *alias = aliases[index].alias;
    *name = aliases[index].name;
    return HEXISEQ_OK;
}

hexiseq_status hexiseq_gpu_catalog_get(int index, hexiseq_gpu_spec *out) {
    hexiseq_clear_error();
    if (!out)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "out must not be NULL");
    if (index < 0 || index >= CATALOG_SIZE)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "catalog index must be in [0, %d), got %d", CATALOG_SIZE, index);
    *out = catalog[index];
    return HEXISEQ_OK;
}

static int same_name(const char *a, const char *b) {
    for (; *a && *b; ++a, ++b)
        if (toupper((unsigned char)*a) != toupper((unsigned char)*b))
            return 0;
    return *a == *b;
}

/* Index of `name` in the catalog, or -1. */
int hexiseq_gpu_index(const char *name) {
    if (!name)
        return -1;
    for (int i = 0; i < CATALOG_SIZE; ++i)
        if (same_name(name, catalog[i].name))
            return i;
    for (size_t a = 0; a < sizeof aliases / sizeof aliases[0]; ++a)
        if (same_name(name, aliases[a].alias))
            return hexiseq_gpu_index(aliases[a].name);
    return -1;
}

void hexiseq_gpu_known_list(char *buf, size_t cap) {
    size_t used = 0;
    if (cap == 0)
        return;
    buf[0] = '\0';
    for (int k = 0; k < CATALOG_SIZE; ++k) {
        size_t n = strlen(catalog[k].name);
        if (used + n + 3 >= cap)
            break;
        if (k) {
            memcpy(buf + used, ", ", 2);
            used += 2;
        }
        memcpy(buf + used, catalog[k].name, n);
        used += n;
        buf[used] = '\0';
    }
}

/* Whether `piece` (lower case) occurs in `text`, letters compared without case. */
static int contains_lower(const char *text, const char *piece) {
    size_t n = strlen(piece);
    for (; *text; ++text) {
        size_t k = 0;
        while (k < n && text[k] && tolower((unsigned char)text[k]) == (unsigned char)piece[k])
            ++k;
        if (k == n)
            return 1;
    }
    return n == 0;
}

const char *hexiseq_gpu_from_device_name(const char *device_name) {
    if (!device_name)
        return NULL;
    for (size_t d = 0; d < sizeof device_names / sizeof device_names[0]; ++d) {
        if (!contains_lower(device_name, device_names[d].piece))
            continue;
        int i = hexiseq_gpu_index(device_names[d].name);
        if (i >= 0)
            return catalog[i].name;
    }
    return NULL;
}

hexiseq_status hexiseq_gpu_find(const char *name, hexiseq_gpu_spec *out) {
    hexiseq_clear_error();
    if (!name || !out)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "name and out must not be NULL");
    int i = hexiseq_gpu_index(name);
    if (i < 0) {
        char known[512];
        hexiseq_gpu_known_list(known, sizeof known);
        return hexiseq_fail(HEXISEQ_ERR_UNKNOWN_GPU, "unknown GPU model '%.64s'; known models: %s", name, known);
    }
    *out = catalog[i];
    return HEXISEQ_OK;
}
