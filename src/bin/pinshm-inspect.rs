//! `pinshm-inspect NAME [ADDRESS:ID ...]`: prints a segment's header, reader
//! table and live slots (read-only), and explains what happened to each
//! `address:id` from a "has been modified or is invalid" error.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(name) = args.first() else {
        eprintln!("usage: pinshm-inspect NAME [ADDRESS:ID ...]   (NAME as in /dev/shm/NAME)");
        std::process::exit(2);
    };
    let snap = match pinshm::inspect::inspect(name) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("pinshm-inspect: {e}");
            std::process::exit(1);
        }
    };
    print!("{snap}");
    for q in &args[1..] {
        let parsed = q.split_once(':').and_then(|(a, i)| {
            Some((
                a.trim_matches('\'').parse::<u64>().ok()?,
                i.trim_matches('\'').parse::<u64>().ok()?,
            ))
        });
        match parsed {
            Some((address, id)) => println!("\n{address}:{id}: {}", snap.explain(address, id)),
            None => println!("\n{q}: not of the form ADDRESS:ID"),
        }
    }
}
