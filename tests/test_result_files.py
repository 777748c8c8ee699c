"""What a speed result records about its CPU (:func:`kvsieve.result_files.cpu_info`): the model name, whether bf16
is native, the vector extensions that pick kvsieve's C paths."""

from __future__ import annotations

import platform

from kvsieve.result_files import cpu_info

AMX_XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2
"""
AVX2_EPYC = """processor\t: 0
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma bmi2
"""
GRAVITON = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd sve bf16 i8mm
CPU implementer\t: 0x41
"""


def test_an_amx_xeon_has_native_bf16_and_every_vector_path():
    info = cpu_info(AMX_XEON)
    assert info["model_name"] == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert info["bf16_flags"] == ["amx_bf16", "avx512_bf16"] and info["bf16_native"] is True
    assert info["vector_flags"] == ["avx2", "fma", "avx512f", "amx_tile"]  # the first core's flags only


def test_an_avx2_only_cpu_has_no_native_bf16():
    info = cpu_info(AVX2_EPYC)
    assert info["model_name"] == "AMD EPYC 7B13"
    assert info["bf16_flags"] == [] and info["bf16_native"] is False
    assert info["vector_flags"] == ["avx2", "fma"]


def test_an_arm_cpu_reads_its_features_line_and_names_the_machine_without_a_model_name():
    info = cpu_info(GRAVITON)
    assert info["bf16_flags"] == ["bf16"] and info["bf16_native"] is True and info["vector_flags"] == []
    assert info["model_name"] == (platform.processor() or platform.machine())


def test_no_cpuinfo_knows_no_flags():
    info = cpu_info("")
    assert info["bf16_native"] is False and info["bf16_flags"] == [] and info["vector_flags"] == []
    assert info["model_name"] == (platform.processor() or platform.machine())
