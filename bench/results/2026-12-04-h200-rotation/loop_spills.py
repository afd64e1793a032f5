"""loop_spills.py FILE.sass...: per file, local loads/stores (LDL/STL) in all and in each loop holding 200+ HMMA."""
import re, sys
for f in sys.argv[1:]:
    ins=[]
    for l in open(f):
        m=re.match(r'\s+/\*([0-9a-f]{4,})\*/\s+(.*?);',l)
        if m: ins.append((int(m.group(1),16),m.group(2)))
    idx={a:i for i,(a,_) in enumerate(ins)}
    loops=[]
    for i,(a,t) in enumerate(ins):
        m2=re.search(r'BRA .*?0x([0-9a-f]+)',t)
        if m2:
            tgt=int(m2.group(1),16)
            if tgt<a and tgt in idx:
                body=ins[idx[tgt]:i+1]
                h=sum('HMMA' in x for _,x in body)
                if h>=200: loops.append((len(body),h,sum('LDL' in x for _,x in body),sum('STL' in x for _,x in body),hex(tgt)))
    print(f, "total LDL/STL", sum('LDL' in x for _,x in ins), sum('STL' in x for _,x in ins), "loops (instr,HMMA,LDL,STL):", sorted(loops,key=lambda x:-x[0])[:5])
