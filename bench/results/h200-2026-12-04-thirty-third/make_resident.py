"""Writes moe_one_launch_resident.py (call 3) from moe_one_launch.py: one program a gate/up tile (P = the tile
count), each compiled kernel's registers and shared memory checked against one SM's before it is launched (a
spinning grid barrier never opens unless every program is resident), T = 1 only."""
import sys
from pathlib import Path

HERE = Path(__file__).parent
EDITS = [
    ('def one_launch(x, w, tw, ids, out, programs, block_n, block_n_d, prefetch_down, prefetch_up, warps=4):',
     'RESIDENT = {}\n\n\ndef one_launch(x, w, tw, ids, out, programs, block_n, block_n_d, prefetch_down, prefetch_up, '
     'warps=4):'),
    ('    w13, w2 = w["w13"], w["w2"]\n    _moe_one_launch[(programs,)](',
     '    w13, w2 = w["w13"], w["w2"]\n'
     '    key = (programs, block_n, block_n_d, prefetch_down, prefetch_up, warps)\n'
     '    launch = _moe_one_launch.warmup if key not in RESIDENT else _moe_one_launch[(programs,)]\n'
     '    extra = dict(grid=(programs,)) if key not in RESIDENT else {}\n'
     '    kern = launch('),
    ('        PREFETCH_DOWN=prefetch_down, PREFETCH_UP=prefetch_up, num_warps=warps, **pdl.launch_options(x.device))\n',
     '        PREFETCH_DOWN=prefetch_down, PREFETCH_UP=prefetch_up, num_warps=warps, **extra, '
     '**pdl.launch_options(x.device))\n'
     '    if key not in RESIDENT:\n'
     '        per_sm = -(-programs // torch.cuda.get_device_properties(0).multi_processor_count)\n'
     "        if hasattr(kern, '_init_handles'):\n"
     '            kern._init_handles()\n'
     '        regs, shared = kern.n_regs, kern.metadata.shared\n'
     '        ok = per_sm * warps * 32 * max(regs, 1) <= 65536 and per_sm * warps <= 64 '
     'and per_sm * shared <= 227 * 1024\n'
     '        print(f"  P={programs}: {regs} regs, {kern.n_spills} spills, {shared} B shared, {per_sm} a SM: "\n'
     "              f\"{'resident' if ok else 'NOT resident'}\", flush=True)\n"
     '        if not ok:\n'
     '            raise RuntimeError("not all programs resident")\n'
     '        RESIDENT[key] = True\n'
     '        one_launch(x, w, tw, ids, out, programs, block_n, block_n_d, prefetch_down, prefetch_up, warps)\n'),
    ('''        for programs in (132, 192, 264, 288, 396):
            for bn in (4, 8):
                for pd_, pu in ((False, False), (True, False), (True, True)):
                    forms.append((f"one P={programs} bn={bn}{' pd' if pd_ else ''}{' pu' if pu else ''}",
                                  (programs, bn, bn_d, pd_, pu)))''',
     '''        for bn in (4, 8):
            programs = (I // bn) * K * T
            for pd_ in (False, True):
                forms.append((f"one P={programs} bn={bn}{' pd' if pd_ else ''}", (programs, bn, bn_d, pd_, False)))'''),
    ("    for T in (1, 2):", "    for T in (1,):"),
]

text = (HERE / "moe_one_launch.py").read_text()
for old, new in EDITS:
    assert text.count(old) == 1, old
    text = text.replace(old, new)
(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "moe_one_launch_resident.py").write_text(text)
